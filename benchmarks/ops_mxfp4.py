"""MXFP4 experts: resident bytes packed vs bf16, and MoE expert tokens/s with the packed bank vs a dense bf16 bank.

Run (after `make venv`, which installs the project):
    .venv/bin/python benchmarks/ops_mxfp4.py [--k3-experts 32] [--seconds 0.5] [--threads N] [--out benchmarks/results/ops_mxfp4.md]
Memory: the tiny() model's routed experts (every MoE layer), and a slice of one K3 expert bank (3 x 3072 x 3584 per expert)
built one expert at a time, so only one expert is ever in full precision; the full layer (896 experts) and the whole model
(92 MoE layers) are extrapolated from the measured bytes per weight. Speed: the grouped MoE op over the packed bank
against the same experts decoded once into a dense bf16 bank; the ratio is printed only if both outputs are identical.
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from openk3.config import k3, tiny
from openk3.ops.activation import situ_glu
from openk3.ops.moe.bank import DenseExpertBank
from openk3.ops.moe.grouped import moe_experts_grouped
from openk3.ops.moe.packed_bank import PackedMXFP4ExpertBank, dense_bank_nbytes
from openk3.ops.mxfp4 import MXFP4Tensor, quantize

SPEED_SHAPES = {"tiny (E16 k4 D128 I128)": (16, 4, 128, 128), "mid (E64 k8 D512 I512)": (64, 8, 512, 512)}
TOKENS = (1, 64)


def _random_experts(e: int, d: int, i: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    return tuple((torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16) for s in ((e, i, d), (e, i, d), (e, d, i)))


def memory_rows(k3_experts: int) -> list[tuple[str, int, int, int]]:
    """(bank, weights, packed bytes, bf16 bytes), all measured from allocated tensors except the extrapolated rows."""
    g = torch.Generator().manual_seed(0)
    cfg = tiny()
    layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    e, d, i = cfg.moe.num_experts, cfg.moe.latent_size or cfg.hidden_size, cfg.moe.moe_intermediate_size
    packed = dense = 0
    for _ in range(layers):
        w = _random_experts(e, d, i, g)
        packed += PackedMXFP4ExpertBank.from_dense(*w).nbytes
        dense += dense_bank_nbytes(DenseExpertBank(*w))
    rows = [(f"tiny(): {layers} layers x {e} experts x 3 x {i} x {d}", layers * e * 3 * i * d, packed, dense)]

    kc = k3()
    ke, kd, ki = kc.moe.num_experts, kc.moe.latent_size or kc.hidden_size, kc.moe.moe_intermediate_size
    shapes = ((ki, kd), (ki, kd), (kd, ki))
    bank = [MXFP4Tensor(torch.empty(k3_experts, r, c // 2, dtype=torch.uint8), torch.empty(k3_experts, r, c // 32, dtype=torch.uint8)) for r, c in shapes]
    dense = 0
    for x in range(k3_experts):  # one expert in bf16 at a time
        for t, (r, c) in zip(bank, shapes, strict=True):
            w = (torch.randn(r, c, generator=g) * 0.02).to(torch.bfloat16)
            dense += w.numel() * w.element_size()
            t.packed[x], t.scales[x] = quantize(w)
    packed = PackedMXFP4ExpertBank(*bank).nbytes
    weights = k3_experts * 3 * ki * kd
    rows.append((f"K3 bank slice: {k3_experts} experts x 3 x {ki} x {kd}", weights, packed, dense))
    layers = sum(kc.is_moe_layer(i) for i in range(kc.num_hidden_layers))
    for name, n in ((f"K3 layer bank ({ke} experts, extrapolated)", ke), (f"K3 all routed ({layers} x {ke}, extrapolated)", layers * ke)):
        rows.append((name, n * 3 * ki * kd, packed * n // k3_experts, dense * n // k3_experts))
    return rows


def _interleaved_tokens_per_s(fns: tuple[Callable[[], torch.Tensor], ...], tokens: int, seconds: float) -> list[float]:
    """Alternate the calls so that both see the same machine load (the CPU may be shared); median time per call."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    start = time.perf_counter()
    while time.perf_counter() - start < seconds * len(fns) or len(times[0]) < 5:
        for fn, ts in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [tokens / statistics.median(ts) for ts in times]


def speed_rows(seconds: float) -> list[tuple[str, int, float, float]]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for name, (e, k, d, i) in SPEED_SHAPES.items():
        packed = PackedMXFP4ExpertBank.from_dense(*_random_experts(e, d, i, g))
        dense = packed.materialize(torch.bfloat16)  # the same weights, decoded once: only the storage differs
        for t in TOKENS:
            x = torch.randn(t, d, generator=g).to(torch.bfloat16)
            idx = torch.randn(t, e, generator=g).topk(k, dim=-1).indices
            w = torch.rand(t, k, generator=g)

            run_dense = functools.partial(moe_experts_grouped, x, idx, w, dense, situ_glu)
            run_packed = functools.partial(moe_experts_grouped, x, idx, w, packed, situ_glu)
            if not torch.equal(run_packed(), run_dense()):
                raise SystemExit(f"{name} T={t}: packed and dense banks disagree; refusing to report speed")
            rows.append((name, t, *_interleaved_tokens_per_s((run_dense, run_packed), t, seconds)))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k3-experts", type=int, default=32, help="experts of the K3-shaped bank slice actually built")
    parser.add_argument("--seconds", type=float, default=0.5, help="timing window per measurement")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--out", default=None, help="also write the tables as markdown to this file")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    lines = [
        f"command: `{' '.join(['.venv/bin/python', *sys.argv])}`",
        f"torch {torch.__version__}, {platform.machine()} CPU, {torch.get_num_threads()} threads, commit {commit}",
        "",
        "| expert bank | weights | MXFP4 bytes | bf16 bytes | bits/weight | MXFP4 / bf16 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, n, packed, dense in memory_rows(args.k3_experts):
        lines.append(f"| {name} | {n:,} | {packed:,} | {dense:,} | {8 * packed / n:.4f} | {packed / dense:.6f} |")
    lines.append(f"\nexpected MXFP4 / bf16 = 4.25 / 16 = {4.25 / 16:.6f}\n")
    lines += [
        "| MoE experts (grouped op, bf16 compute, SiTU) | tokens | dense bf16 tok/s | packed MXFP4 tok/s | packed / dense |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, t, dense_tps, packed_tps in speed_rows(args.seconds):
        lines.append(f"| {name} | {t} | {dense_tps:,.0f} | {packed_tps:,.0f} | {packed_tps / dense_tps:.3f} |")
    lines.append("\noutputs of the packed and dense banks were checked identical (torch.equal) before timing")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(f"# MXFP4 expert storage: memory and CPU speed\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
