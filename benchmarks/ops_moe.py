"""Routed experts: tokens/s of the grouped and batched fast paths (and the auto choice) against the naive per-expert mask loop.

Run (after `make venv`, which installs the project):
    .venv/bin/python benchmarks/ops_moe.py [--device cpu|cuda] [--dtype float32|bfloat16] [--seconds 0.5] [--threads N]
                                           [--experts 16] [--top-k 4]
Every path sees the same router output; a ratio is printed only if the path agrees with naive (fp32 1e-5, bf16 2e-2).
The T column spans decode-sized steps (where the batched path's fixed op count wins) to prefill-sized ones (where the grouped
loop's dense per-expert matmuls win); ops/moe/__init__.py's auto thresholds come from this table.
"""

from __future__ import annotations

import argparse
import functools
import platform
import subprocess
import sys
import time

import torch

from openk3.config import Activation
from openk3.ops.activation import glu
from openk3.ops.moe import (
    DenseExpertBank,
    MoEExpertsFn,
    moe_experts_naive,
    sigmoid_topk_route,
)
from openk3.ops.registry import OpTarget, op

D, I = 256, 128
TOKENS = (1, 4, 16, 64, 256, 1024)
PATHS = (("grouped", "fast"), ("batched", "batched"), ("auto", "sized"))  # (column, the registry's "moe_experts" name)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tokens_per_s(fn: MoEExpertsFn, args: tuple, tokens: int, seconds: float, device: torch.device) -> float:
    fn(*args)
    _sync(device)
    calls, start = 0, time.perf_counter()
    while True:
        fn(*args)
        calls += 1
        _sync(device)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and calls >= 3:
            return tokens * calls / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seconds", type=float, default=0.5, help="timing window per measurement")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    args = parser.parse_args()
    E, K = args.experts, args.top_k
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    target = OpTarget(device.type, dtype=dtype)  # each path's entry for this device and dtype (ops/registry.py)
    fast: dict[str, MoEExpertsFn] = {name: op("moe_experts", impl, target) for name, impl in PATHS}
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"torch {torch.__version__}, {platform.machine()} {torch.get_num_threads()} threads, device {device}, commit {commit}")
    print(f"E={E} k={K} D={D} I={I} act=situ dtype={args.dtype}\n")

    g = torch.Generator().manual_seed(0)
    bank = DenseExpertBank(
        *(
            t.to(device, dtype)
            for t in (
                torch.randn(E, I, D, generator=g) / D**0.5,
                torch.randn(E, I, D, generator=g) / D**0.5,
                torch.randn(E, D, I, generator=g) / I**0.5,
            )
        )
    )
    router_w, router_b = torch.randn(E, D, generator=g).to(device), (0.1 * torch.randn(E, generator=g)).to(device)
    act = functools.partial(glu, kind=Activation.SITU)
    print("| T | naive tok/s | grouped tok/s | batched tok/s | auto tok/s | grouped / naive | batched / grouped | auto / grouped |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    ok = True
    for t in TOKENS:
        x = torch.randn(t, D, generator=g).to(device, dtype)
        route = sigmoid_topk_route(x, router_w, router_b, K, True, 1.0)
        call = (x, route.topk_idx, route.topk_weight, bank, act)
        want = moe_experts_naive(*call).float()
        diffs = {name: (fn(*call).float() - want).abs().max().item() for name, fn in fast.items()}
        if max(diffs.values()) > tol:
            ok = False
            print(f"| {t} | refused: a fast path != naive ({diffs}) |")
            continue
        naive = _tokens_per_s(moe_experts_naive, call, t, args.seconds, device)
        rate = {name: _tokens_per_s(fn, call, t, args.seconds, device) for name, fn in fast.items()}
        g_, b_, a_ = rate["grouped"], rate["batched"], rate["auto"]
        print(f"| {t} | {naive:,.0f} | {g_:,.0f} | {b_:,.0f} | {a_:,.0f} | {g_ / naive:.2f}x | {b_ / g_:.2f}x | {a_ / g_:.2f}x |")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
