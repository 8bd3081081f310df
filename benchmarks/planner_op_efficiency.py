"""Per-operator efficiency curves from AIConfigurator's public per-kernel tables: printed, and with --write the small
derived table the planner ships (openk3/planner/op_efficiency.json, issue 37 item 1).

    git clone https://github.com/ai-dynamo/aiconfigurator    # or any checkout of it; its tables are Apache-2.0 data
    pip install pyarrow                                      # to read the parquet tables; not an openk3 dependency
    .venv/bin/python benchmarks/planner_op_efficiency.py PATH/TO/aiconfigurator [--write openk3/planner/op_efficiency.json]

For every measured kernel the roofline time is max(FLOPs / dense peak, bytes / HBM bandwidth) at the catalogue's figures
for the measured GPU (H200: 989 TF bf16, 1,979 TF fp8, 4.8 TB/s; B200: 2,250 / 4,500 / 9,000 TF bf16 / fp8 / fp4, 8 TB/s),
and its efficiency is roofline time / measured latency -- the factor by which the planner divides its roofline time for
that operator at that shape. One curve per operator, by the shape that moves it, median over the other dimensions the
table sweeps:

- GEMM (`gemm_perf`): by tokens m; weights of at least 7168 x 2048 (trunk projections of DeepSeek-class models); per dtype.
- grouped GEMM / MoE (`moe_perf`, SGLang's fused MoE): by routed tokens per expert (tokens x top-k / experts) on one rank
  (moe_ep_size 1: the table's EP rows could not be tied to a per-rank token count, so only the unambiguous rows are used),
  DeepSeek-V3 shape (7168 / 2048, 256 experts, top-8), balanced routing; per dtype.
- attention prefill (`context_mla_perf`, bf16): by prompt length; causal, qk 192 + v 128 per head (DeepSeek MLA, expanded).
- attention decode (`generation_mla_perf`, bf16): a grid by query heads, batch (sequences in the call) and cached tokens
  per sequence, absorbed MLA; and the same grid over an FP8 cache (`kv_cache_dtype` fp8, bf16 MLA inputs) from
  TensorRT-LLM's table (`mla/trtllm/1.3.0rc20`, the fastest FP8-cache kernel measured on both GPUs; see
  FP8_CACHE_VERSION), whose roofline reads one byte per latent value and counts the math at the FP8 peak, used for
  every FP8-cache MLA decode step (issue 37 round seven: on B200 the FP8-cache kernel takes 0.6x the bf16 one's time,
  and beats the bf16-math roofline by up to 1.3x, so it multiplies in FP8). (Until issue 37 round three this was one
  curve by batch x cached tokens; the kernels are far from one curve of the product: at ~1M tokens read, 512 sequences
  of 2K reach 0.53 of the roofline on H200 and 8 of 128K 0.63.)
- GQA attention prefill / decode (`context_attention_perf` / `generation_attention_perf`, bf16, at least 4 query heads
  per KV head; decode: head_dim 128): by prompt length / the same (heads, batch, cached tokens per sequence) grid as MLA.
  Where SGLang's prefill table is not physical (B200: 4x the roofline), TensorRT-LLM's (FP8_CACHE_VERSION) gives it.
- all-reduce (`custom_allreduce_perf`, SGLang custom all-reduce under CUDA graphs): by message bytes, per group size;
  efficiency = ring time 2 (g - 1) / g x bytes / NVLink bandwidth per direction / measured latency.

Hopper curves are measured on H200 and used for H100/H800/H200; Blackwell curves on B200 and used for B200/GB200/B300/GB300.
The all-to-all keeps the planner's latency-floor + link-bandwidth model (its anchors are DeepEP's published tables).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

DATA = "aic-core/src/aiconfigurator_core/systems/data"
VERSION = "sglang/0.5.10"
# MLA decode over an FP8 cache: TensorRT-LLM's table. SGLang 0.5.10 runs it on H200 with its flash_attention backend at
# 4.5x its bf16 time (0.171 against 0.056 ms per layer at 128 heads, 32 x 2K), TensorRT-LLM at 0.9x (0.052 against
# 0.057 ms); on B200 both run TensorRT-LLM's trtllm-gen kernel (SGLang's kernel_source "trtllm_mla").
FP8_CACHE_VERSION = "trtllm/1.3.0rc20"
GPUS: dict[str, dict[str, Any]] = {  # the catalogue's figures for the measured GPU (openk3/planner/catalogue.json)
    "hopper": dict(dir="h200_sxm", bw=4.8e12, bf16=989e12, fp8=1979e12, fp4=1979e12, nvlink=450e9),
    "blackwell": dict(dir="b200_sxm", bw=8.0e12, bf16=2250e12, fp8=4500e12, fp4=9000e12, nvlink=900e9),
}
USED_FOR = {"hopper": ["h100-sxm", "h800-sxm", "h200-sxm"], "blackwell": ["b200", "gb200", "b300", "gb300"]}
GEMM_DTYPES = {"fp8": ("fp8", 1.0), "bf16": ("bfloat16", 2.0), "fp4": ("nvfp4", 0.5625)}  # planner name: (table name, bytes/weight)
MOE_DTYPES = {"fp8": ("fp8_block", 1.0), "bf16": ("bfloat16", 2.0), "fp4": ("nvfp4", 0.5625)}
QK, V, LATENT, LATENT_V = 192, 128, 576, 512  # DeepSeek-V3 MLA widths the tables were collected for
H, I, E, K = 7168, 2048, 256, 8  # DeepSeek-V3 MoE shape
GQA_HEAD_DIM = 128  # Qwen3's and Llama's; the decode grid keeps these rows


def _rows(root: Path, gpu: str, rel: str) -> list[dict]:
    import pyarrow.parquet as pq  # optional: only this script reads parquet

    return pq.read_table(root / DATA / GPUS[gpu]["dir"] / rel).to_pylist()


def _median(v: list[float]) -> float:
    s = sorted(v)
    return s[len(s) // 2]


def _curve(rows: Iterable[dict], key: Callable[[dict], float], roofline: Callable[[dict], float]) -> list[list[float]]:
    by: dict[float, list[float]] = collections.defaultdict(list)
    for r in rows:
        by[key(r)].append(roofline(r) / (r["latency"] * 1e-3))  # latency is in ms
    return [[k, float(f"{_median(v):.4g}")] for k, v in sorted(by.items())]


def _pow2(curve: list[list[float]]) -> list[list[float]]:
    """Keep the powers of two (and the last point) of a dense sweep: the interpolation between them is log-linear."""
    return [p for p in curve if (int(p[0]) & (int(p[0]) - 1) == 0 and p[0] == int(p[0])) or p is curve[-1]]


def gemm(root: Path, gpu: str, dtype: str) -> list[list[float]]:
    g = GPUS[gpu]
    name, wbytes = GEMM_DTYPES[dtype]

    def roof(r: dict) -> float:
        m, n, k = r["m"], r["n"], r["k"]
        return max(2 * m * n * k / g[dtype], (n * k * wbytes + m * k * 2 + 2 * m * n) / g["bw"])

    rows = [r for r in _rows(root, gpu, f"gemm/{VERSION}/gemm_perf.parquet") if r["gemm_dtype"] == name and r["n"] * r["k"] >= H * I]
    return _pow2(_curve(rows, lambda r: r["m"], roof)) if rows else []


def moe(root: Path, gpu: str, dtype: str) -> list[list[float]]:
    g = GPUS[gpu]
    name, wbytes = MOE_DTYPES[dtype]

    def roof(r: dict) -> float:
        n = r["num_tokens"]
        hit = E * (1 - (1 - K / E) ** n)
        flops = 2 * 3 * H * I * n * K
        return max(flops / g[dtype], (hit * 3 * H * I * wbytes + n * K * H * 4) / g["bw"])

    rows = [
        r
        for r in _rows(root, gpu, f"moe/{VERSION}/moe_perf.parquet")
        if r["moe_dtype"] == name and (r["hidden_size"], r["inter_size"], r["num_experts"], r["topk"]) == (H, I, E, K)
        and r["distribution"] == "balanced" and r["moe_ep_size"] == 1 and r["moe_tp_size"] == 1
    ]  # fmt: skip
    return [[round(n * K / E, 4), eff] for n, eff in _pow2(_curve(rows, lambda r: r["num_tokens"], roof))] if rows else []


def attention_prefill(root: Path, gpu: str) -> list[list[float]]:
    g = GPUS[gpu]

    def roof(r: dict) -> float:
        b, h, s = r["batch_size"], r["num_heads"], r["isl"]
        flops = b * h * s * (s + 1) / 2 * 2 * (QK + V)
        return max(flops / g["bf16"], b * s * h * (2 * QK + V) * 2 / g["bw"])

    rows = (r for r in _rows(root, gpu, f"mla/{VERSION}/context_mla_perf.parquet") if r["mla_dtype"] == "bfloat16" and r["kv_cache_dtype"] == "bfloat16")
    return _pow2(_curve(rows, lambda r: r["isl"], roof))


def _grid(rows: Iterable[dict], roofline: Callable[[dict], float]) -> dict[str, dict[str, list[list[float]]]]:
    """query heads -> batch -> curve by cached tokens per sequence (step + 1), median over the other dimensions."""
    by: dict[int, dict[int, list[dict]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in rows:
        by[r["num_heads"]][r["batch_size"]].append(r)
    return {str(h): {str(b): _pow2(_curve(rs, lambda r: r["step"] + 1, roofline)) for b, rs in sorted(batches.items())} for h, batches in sorted(by.items())}


def attention_decode(root: Path, gpu: str, cache: str = "bfloat16", version: str = VERSION) -> dict[str, dict[str, list[list[float]]]]:
    """`cache`: the KV cache's dtype in the table ("bfloat16" or "fp8"); the roofline reads the cache at its own width
    (2 or 1 byte per latent value) and counts the math at the peak of that width (the FP8-cache kernel beats the bf16
    math roofline on B200, up to 1.3x: it multiplies in FP8), as the planner prices such a step."""
    g = GPUS[gpu]
    width, math_peak = {"bfloat16": (2, g["bf16"]), "fp8": (1, g["fp8"])}[cache]

    def roof(r: dict) -> float:
        b, h, s = r["batch_size"], r["num_heads"], r["step"] + 1
        return max(b * h * s * 2 * (LATENT + LATENT_V) / math_peak, b * s * LATENT * width / g["bw"])

    rows = (
        r
        for r in _rows(root, gpu, f"mla/{version}/generation_mla_perf.parquet")
        if r["mla_dtype"] == "bfloat16" and r["kv_cache_dtype"] == cache and r["step"] >= 1
    )
    return _grid(rows, roof)


def _gqa(r: dict) -> bool:
    """Grouped-query shapes (at least 4 query heads per KV head, as Qwen3 / Llama-class models run them)."""
    return r["num_heads"] >= 4 * r["num_key_value_heads"] and r["kv_cache_dtype"] == "bfloat16" and r["attn_dtype"] == "bfloat16"


def gqa_prefill(root: Path, gpu: str, version: str = VERSION) -> list[list[float]]:
    g = GPUS[gpu]

    def roof(r: dict) -> float:
        b, h, kv, d, s = r["batch_size"], r["num_heads"], r["num_key_value_heads"], r["head_dim"], r["isl"]
        flops = b * h * s * (s + 1) / 2 * 2 * 2 * d
        return max(flops / g["bf16"], b * s * (h + 2 * kv) * d * 2 / g["bw"])

    rows = (r for r in _rows(root, gpu, f"attention/{version}/context_attention_perf.parquet") if _gqa(r))
    return _pow2(_curve(rows, lambda r: r["isl"], roof))


def gqa_decode(root: Path, gpu: str) -> dict[str, dict[str, list[list[float]]]]:
    g = GPUS[gpu]

    def roof(r: dict) -> float:
        b, h, kv, d, s = r["batch_size"], r["num_heads"], r["num_key_value_heads"], r["head_dim"], r["step"] + 1
        return max(b * h * s * 2 * 2 * d / g["bf16"], b * s * 2 * kv * d * 2 / g["bw"])

    rows = (
        r for r in _rows(root, gpu, f"attention/{VERSION}/generation_attention_perf.parquet") if _gqa(r) and r["step"] >= 1 and r["head_dim"] == GQA_HEAD_DIM
    )
    return _grid(rows, roof)


def allreduce(root: Path, gpu: str) -> dict[str, list[list[float]]]:
    g = GPUS[gpu]
    rows = [r for r in _rows(root, gpu, f"comm/{VERSION}/custom_allreduce_perf.parquet") if r["backend"] == "sglang_graph"]
    out = {}
    for n in sorted({r["num_gpus"] for r in rows}):
        mine = (r for r in rows if r["num_gpus"] == n)

        def ring(r: dict, n: int = n) -> float:
            return 2 * (n - 1) / n * r["message_size"] / g["nvlink"]

        out[str(n)] = _pow2(_curve(mine, lambda r: r["message_size"], ring))
    return out


def _physical(curve: Any, name: str) -> Any:
    """A curve (or grid of curves) that claims to beat the roofline somewhere measures something else than the roofline
    prices; left out."""
    points = [p for g in curve.values() for c in g.values() for p in c] if isinstance(curve, dict) else curve
    if any(e > 1 for _, e in points):
        print(f"left out {name}: efficiency {max(e for _, e in points):.2f} > 1 at some shape (not the operator the roofline prices)")
        return None
    return curve


def family(root: Path, gpu: str) -> dict:
    # SGLang's B200 GQA prefill table claims 4x the roofline (not the operator the roofline prices); TensorRT-LLM's
    # (FP8_CACHE_VERSION's context_attention_perf) is physical there and measures the kernel TensorRT-LLM runs
    prefill = _physical(gqa_prefill(root, gpu), f"{gpu} gqa_attention_prefill")
    if prefill is None:
        prefill = _physical(gqa_prefill(root, gpu, FP8_CACHE_VERSION), f"{gpu} gqa_attention_prefill ({FP8_CACHE_VERSION})")
    optional = {
        "gqa_attention_prefill": prefill,
        "gqa_attention_decode": _physical(gqa_decode(root, gpu), f"{gpu} gqa_attention_decode"),
        "attention_decode_fp8_cache": _physical(attention_decode(root, gpu, "fp8", FP8_CACHE_VERSION), f"{gpu} attention_decode_fp8_cache"),
    }
    return {
        "measured_on": GPUS[gpu]["dir"],
        "used_for": USED_FOR[gpu],
        "gemm": {d: c for d in GEMM_DTYPES if (c := gemm(root, gpu, d))},
        "moe": {d: c for d in MOE_DTYPES if (c := moe(root, gpu, d))},
        "attention_prefill": attention_prefill(root, gpu),
        "attention_decode": attention_decode(root, gpu),
        "allreduce": allreduce(root, gpu),
    } | {k: v for k, v in optional.items() if v is not None}


def _dump(table: dict) -> str:
    """Indented JSON with each (shape, efficiency) point on one line, so a regenerated table diffs by point."""
    return re.sub(r"\[\s+([-+.\deE]+),\s+([-+.\deE]+)\s+\]", r"[\1, \2]", json.dumps(table, indent=1))


def _commit(root: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("aiconfigurator", type=Path, help="a checkout of github.com/ai-dynamo/aiconfigurator")
    p.add_argument("--commit", default=None, help="the checkout's commit when it is not a git work tree")
    p.add_argument("--write", type=Path, default=None, help="write the derived table (JSON) here")
    args = p.parse_args()
    root = args.aiconfigurator
    commit = args.commit or _commit(root)
    print(f"command: python {' '.join(sys.argv)}; AIConfigurator commit {commit}")
    table: dict = {
        "origin": f"derived by benchmarks/planner_op_efficiency.py from AIConfigurator's collected per-kernel tables "
        f"(github.com/ai-dynamo/aiconfigurator, commit {commit}, {DATA}/<gpu>/<op>/{VERSION}/*.parquet; the FP8-cache MLA "
        f"decode grid from <gpu>/mla/{FP8_CACHE_VERSION}/generation_mla_perf.parquet, Blackwell's GQA prefill from "
        f"b200_sxm/attention/{FP8_CACHE_VERSION}/context_attention_perf.parquet)",
        "licence": "Apache-2.0 (the AIConfigurator repository's licence, NVIDIA CORPORATION & AFFILIATES); medians of its measurements",
        "meaning": "efficiency = roofline time (max of FLOPs / dense peak, bytes / HBM bandwidth) / measured kernel time, "
        "log-linear between points, clamped at the ends; decode attention is a grid: query heads -> batch -> curve by cached "
        "tokens per sequence (nearest measured head count, log-linear in batch and tokens); see the script's docstring",
        "families": {name: family(root, name) for name in GPUS},
    }
    for name, fam in table["families"].items():
        print(f"\n{name} (measured on {fam['measured_on']})")
        for op in ("gemm", "moe", "allreduce"):
            for k, curve in fam[op].items():
                print(f"  {op} {k}: " + ", ".join(f"{x:g}:{e:.2f}" for x, e in curve))
        for op in ("attention_prefill", "gqa_attention_prefill"):
            if op in fam:
                print(f"  {op}: " + ", ".join(f"{x:g}:{e:.2f}" for x, e in fam[op]))
        for op in ("attention_decode", "attention_decode_fp8_cache", "gqa_attention_decode"):
            for heads, grid in fam.get(op, {}).items():
                for batch, curve in grid.items():
                    print(f"  {op} {heads} heads, batch {batch}: " + ", ".join(f"{x:g}:{e:.2f}" for x, e in curve))
    if args.write:
        args.write.write_text(_dump(table) + "\n")
        print(f"\nwrote {args.write}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
