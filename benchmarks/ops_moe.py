"""Routed experts: tokens/s of the grouped fast path against the naive per-expert mask loop, at the demo size.

Run (after `make venv`, which installs the project):
    .venv/bin/python benchmarks/ops_moe.py [--device cpu|cuda] [--dtype float32|bfloat16] [--seconds 0.5] [--threads N]
Both paths see the same router output; the speed-up is printed only if they agree (fp32 1e-5, bf16 2e-2).
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
from openk3.ops.moe import DenseExpertBank, MoEExpertsFn, moe_experts_grouped, moe_experts_naive, sigmoid_topk_route

E, K, D, I = 16, 4, 256, 128
TOKENS = (1, 64, 512)


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
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
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
    print("| T | naive tok/s | grouped tok/s | grouped / naive | max abs diff |")
    print("|---:|---:|---:|---:|---:|")
    ok = True
    for t in TOKENS:
        x = torch.randn(t, D, generator=g).to(device, dtype)
        route = sigmoid_topk_route(x, router_w, router_b, K, True, 1.0)
        call = (x, route.topk_idx, route.topk_weight, bank, act)
        diff = (moe_experts_grouped(*call).float() - moe_experts_naive(*call).float()).abs().max().item()
        if diff > tol:
            ok = False
            print(f"| {t} | - | - | refused: grouped != naive | {diff:.2e} |")
            continue
        naive = _tokens_per_s(moe_experts_naive, call, t, args.seconds, device)
        grouped = _tokens_per_s(moe_experts_grouped, call, t, args.seconds, device)
        print(f"| {t} | {naive:,.0f} | {grouped:,.0f} | {grouped / naive:.2f}x | {diff:.1e} |")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
