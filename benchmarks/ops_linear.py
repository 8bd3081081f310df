"""Projection speed at serving step sizes: `ops.linear`'s CPU forms / `ops.bmm_weight_t` against F.linear / matmul, same run, CPU fp32.

The registry's CPU "linear" is shown twice: with the C kernel for up to KERNEL_ROWS rows (`linear_c`, ops/cpu/linear.c, the
"c" backend), and in the torch forms alone (`linear_cpu`: weight-first mm, oneDNN; the "cpu" backend, what runs without a
compiler); the packed-weight form needs a model's PackedWeight and is left to the engine benchmark.

Two cache regimes, because the choice in ops/linear.py depends on whether the weight is streamed from memory:
  cold: the call cycles over enough copies of the weight to overflow the last-level cache (what a decode step sees when its
        weights exceed the cache, e.g. every expert active at 16 sequences);
  hot:  the same weight every call (a small model whose step's weights stay in cache).
Each cell is microseconds per call; a ratio is baseline / ours (above 1: ours is faster).

  python benchmarks/ops_linear.py --threads 2
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from openk3.ops.cpu.build import kernels_available
from openk3.ops.linear import bmm_weight_t, linear_c, linear_cpu

CACHE_BYTES = 96 * 2**20  # cycled working set for "cold": above the L3 of the machines this runs on


def per_call_us(calls: list[Callable[[], object]], repeats: int) -> float:
    for call in calls:
        call()
    start = time.perf_counter()
    for _ in range(repeats):
        for call in calls:
            call()
    return (time.perf_counter() - start) / (repeats * len(calls)) * 1e6


def copies_for(regime: str, weight_bytes: int) -> int:
    return 1 if regime == "hot" else max(4, CACHE_BYTES // weight_bytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,2,4,8,16,64")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"command: python benchmarks/ops_linear.py --threads {args.threads} --rows {args.rows}")
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} threads; commit {commit}\n")

    print("| weight [N, K] | what | regime | rows | F.linear us | torch forms us | with the C kernel us | vs F.linear | vs torch forms |")
    print("|---|---|---|---|---|---|---|---|---|")
    shapes = [
        ((4096, 256), "LM head"),
        ((1536, 256), "dense gate|up"),
        ((900, 256), "KDA q|k|v|f_a|g_a|b"),
        ((256, 256), "o_proj"),
        ((256, 128), "shared-expert down"),
        ((256, 64), "KDA f_b"),
    ]
    if not kernels_available():
        raise SystemExit("the CPU kernels could not be built here (no C compiler?): the C column cannot be measured")
    with torch.inference_mode():
        for (n, k), what in shapes:
            for regime in ("cold", "hot"):
                weights = [torch.randn(n, k) for _ in range(copies_for(regime, n * k * 4))]
                for m in rows:
                    x = torch.randn(m, k)
                    repeats = max(3, 2000 // len(weights))
                    base = per_call_us([lambda w=w, x=x: F.linear(x, w) for w in weights], repeats)
                    forms = per_call_us([lambda w=w, x=x: linear_cpu(x, w) for w in weights], repeats)
                    ours = per_call_us([lambda w=w, x=x: linear_c(x, w) for w in weights], repeats)
                    print(f"| [{n}, {k}] | {what} | {regime} | {m} | {base:.1f} | {forms:.1f} | {ours:.1f} | {base / ours:.2f}x | {forms / ours:.2f}x |")

        print("\n| experts [A, N, K] | regime | rows per expert | matmul(x, W^T) us | bmm_weight_t us | ratio |")
        print("|---|---|---|---|---|---|")
        for a, n, k in [(16, 128, 256), (16, 256, 128)]:
            for regime in ("cold", "hot"):
                weights = [torch.randn(a, n, k) for _ in range(copies_for(regime, a * n * k * 4))]
                for c in [r for r in rows if r <= 16]:
                    x = torch.randn(a, c, k)
                    base = per_call_us([lambda w=w, x=x: torch.matmul(x, w.transpose(1, 2)) for w in weights], max(3, 1000 // len(weights)))
                    ours = per_call_us([lambda w=w, x=x: bmm_weight_t(x, w) for w in weights], max(3, 1000 // len(weights)))
                    print(f"| [{a}, {n}, {k}] | {regime} | {c} | {base:.1f} | {ours:.1f} | {base / ours:.2f}x |")


if __name__ == "__main__":
    main()
