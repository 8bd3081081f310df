"""Measured per-operator efficiency on H200, read from AIConfigurator's public per-op tables, beside the planner's flat
defaults (issue 37 item 1: the first step towards per-operator, shape-dependent efficiency).

    git clone https://github.com/ai-dynamo/aiconfigurator    # or any checkout of it; its tables are Apache-2.0 data
    pip install pyarrow                                      # to read the parquet tables; not an openk3 dependency
    .venv/bin/python benchmarks/planner_op_efficiency.py PATH/TO/aiconfigurator

For every measured kernel the roofline time is max(FLOPs / dense peak, bytes / HBM bandwidth) at the catalogue's H200
figures (989 TF bf16, 1,979 TF fp8, 4.8 TB/s), and its efficiency is roofline time / measured latency -- the factor the
planner's max(bytes / (BW x eff_hbm), FLOPs / (peak x eff)) would need on that shape. One table per operator, by the
shape that moves it (tokens for a GEMM, prompt length for prefill attention, cached tokens for decode attention),
median over the other dimensions the table sweeps. Nothing here changes the planner: the numbers say where its flat
0.8 / 0.5 / 0.3 defaults sit against measured kernels, so a later change can fit curves to them and keep the
validation cases (openk3/planner/validation.py) held out.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

H200_BW, H200_BF16, H200_FP8 = 4.8e12, 989e12, 1979e12  # catalogue.json, h200-sxm
DATA = "aic-core/src/aiconfigurator_core/systems/data/h200_sxm"
TABLES = {
    "gemm": f"{DATA}/gemm/sglang/0.5.10/gemm_perf.parquet",
    "mla_context": f"{DATA}/mla/sglang/0.5.10/context_mla_perf.parquet",
    "mla_generation": f"{DATA}/mla/sglang/0.5.10/generation_mla_perf.parquet",
}
DEEPSEEK_QK, DEEPSEEK_V, LATENT, LATENT_V = 192, 128, 576, 512  # the MLA widths the tables were collected for (DeepSeek-V3)


def _rows(root: Path, name: str) -> list[dict]:
    import pyarrow.parquet as pq  # optional: only this script reads parquet

    return pq.read_table(root / TABLES[name]).to_pylist()


def _median(v: list[float]) -> float:
    s = sorted(v)
    return s[len(s) // 2]


def _curve(rows: Iterable[dict], key: Callable[[dict], int], roofline: Callable[[dict], float]) -> dict[int, tuple[float, int]]:
    by: dict[int, list[float]] = collections.defaultdict(list)
    for r in rows:
        by[key(r)].append(roofline(r) / (r["latency"] * 1e-3))  # latency is in ms
    return {k: (_median(v), len(v)) for k, v in sorted(by.items())}


def gemm(root: Path) -> dict[int, tuple[float, int]]:
    """FP8 GEMMs with at least a 7168 x 2048 weight (the trunk projections of a DeepSeek-class model), by tokens m."""

    def roof(r: dict) -> float:
        m, n, k = r["m"], r["n"], r["k"]
        return max(2 * m * n * k / H200_FP8, (m * k + k * n + 2 * m * n) / H200_BW)

    rows = (r for r in _rows(root, "gemm") if r["gemm_dtype"] == "fp8" and r["n"] * r["k"] >= 7168 * 2048)
    return _curve(rows, lambda r: r["m"], roof)


def mla_context(root: Path) -> dict[int, tuple[float, int]]:
    """Prefill attention (bf16, causal), by prompt length: qk over 192 and pv over 128 per head, half the pairs."""

    def roof(r: dict) -> float:
        b, h, s = r["batch_size"], r["num_heads"], r["isl"]
        flops = b * h * s * s / 2 * 2 * (DEEPSEEK_QK + DEEPSEEK_V)
        return max(flops / H200_BF16, b * s * h * (2 * DEEPSEEK_QK + DEEPSEEK_V) * 2 / H200_BW)

    rows = (r for r in _rows(root, "mla_context") if r["mla_dtype"] == "bfloat16" and r["kv_cache_dtype"] == "bfloat16")
    return _curve(rows, lambda r: r["isl"], roof)


def mla_generation(root: Path) -> dict[int, tuple[float, int]]:
    """Decode attention (absorbed MLA, bf16 latent), by cached tokens per sequence (the table's `step`)."""

    def roof(r: dict) -> float:
        b, h, s = r["batch_size"], r["num_heads"], r["step"]
        return max(b * h * s * 2 * (LATENT + LATENT_V) / H200_BF16, b * s * LATENT * 2 / H200_BW)

    rows = (r for r in _rows(root, "mla_generation") if r["mla_dtype"] == "bfloat16" and r["kv_cache_dtype"] == "bfloat16" and r["step"] >= 1)
    return _curve(rows, lambda r: r["step"] + 1, roof)


def _commit(root: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("aiconfigurator", type=Path, help="a checkout of github.com/ai-dynamo/aiconfigurator")
    args = p.parse_args()
    root = args.aiconfigurator
    print(f"command: python {' '.join(sys.argv)}; AIConfigurator commit {_commit(root)}")
    planner = {"gemm": "0.5 of peak when compute-bound, 0.8 of HBM when streaming", "mla_context": "0.3 of peak", "mla_generation": "0.3 of peak, 0.8 of HBM"}
    for name, fn in (("gemm", gemm), ("mla_context", mla_context), ("mla_generation", mla_generation)):
        curve = fn(root)
        print(f"\n{name} ({TABLES[name]}); planner default: {planner[name]}\n")
        print("| shape | kernels | roofline efficiency (median) |")
        print("|---|---|---|")
        for shape, (eff, n) in curve.items():
            if shape & (shape - 1) == 0 or shape == max(curve):  # powers of two and the largest
                print(f"| {shape:,} | {n} | {eff:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
