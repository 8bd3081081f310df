"""The CPU kernels of openk3/ops/cpu against the torch ops they replace, same run, same inputs (CPU fp32, inference).

Each row times one call of the op as the engine makes it at a decode step (batch 1 and 16 sequences, the shapes of
`engine_offline.py`'s model: hidden 256, 4 KDA heads of 64, 16 experts top-2), with the kernel and with the kernel switched
off (the torch path the op falls back to). Ratio = torch / kernel.

  python benchmarks/cpu_kernels.py --threads 2
"""

from __future__ import annotations

import argparse
import functools
import platform
import subprocess
import time
from collections.abc import Callable

import torch

from openk3.config import Activation, KDAGate
from openk3.ops.activation import glu
from openk3.ops.cpu.build import kernels_available
from openk3.ops.kda import decode_fused
from openk3.ops.kda.decode_inplace import kda_decode_
from openk3.ops.kda.gate import kda_gate
from openk3.ops.moe import DenseExpertBank
from openk3.ops.norm import l2_norm, rms_norm
from openk3.ops.registry import OpTarget, op
from openk3.ops.short_conv import causal_conv1d_update_

H, D, HIDDEN, EXPERTS, TOP_K, INTER = 4, 64, 256, 16, 2, 128
MLA_HEADS, NOPE, ROPE, V_DIM, RANK, PAGE, CONTEXT = 4, 32, 32, 64, 128, 16, 256


def per_call_us(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(10):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e6


def kda_torch_step(x, conv_w, conv_pool, slots, f, A_log, dt_bias, b, state_pool, norm_w, gate):  # type: ignore[no-untyped-def]
    """model/kda.py's torch ops for the same decode token (slots consecutive: the pools are advanced through a slice)."""
    n = slots.numel()
    qkv = causal_conv1d_update_(x, conv_w, conv_pool[:n], "silu").view(n, 3, H, D)
    q, k = l2_norm(qkv[:, :2]).unbind(1)
    g = kda_gate(f.view(n, H, D), A_log, dt_bias, KDAGate.SOFTPLUS)
    o = kda_decode_(q, k, qkv[:, 2], g, torch.sigmoid(b), state_pool[:n])
    return (rms_norm(o, norm_w, 1e-6) * torch.sigmoid(gate.view(n, H, D))).reshape(n, H * D)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2000)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels_available():
        raise SystemExit("the CPU kernels could not be built here (no C compiler?): nothing to compare")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"command: python benchmarks/cpu_kernels.py --threads {args.threads} --repeats {args.repeats}")
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} threads; commit {commit}\n")
    print("| op | sequences | torch ops us | C kernel us | ratio |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for n in (1, 16):
            for name, slow, fast in timings_at(n, args.repeats, torch.Generator().manual_seed(n)):
                print(f"| {name} | {n} | {slow:.1f} | {fast:.1f} | {slow / fast:.2f}x |")


def timings_at(n: int, repeats: int, g: torch.Generator) -> list[tuple[str, float, float]]:
    """(op, torch-path us, kernel us) for n sequences."""
    rand = lambda *shape: torch.randn(*shape, generator=g)
    p = H * D
    x, f, b, gate = rand(n, 3 * p), rand(n, p), rand(n, H), rand(n, p)
    conv_w, conv_pool, state_pool = rand(3 * p, 4), rand(64, 3 * p, 3), rand(64, H, D, D) * 0.1
    A_log, dt_bias, norm_w, slots = rand(H) * 0.5, rand(p), torch.ones(D), torch.arange(n)
    kernel = lambda: decode_fused.kda_decode_fused(
        x, conv_w, conv_pool, slots, None, f, A_log, dt_bias, b, state_pool, KDAGate.SOFTPLUS, None, norm_w, 1e-6, gate
    )
    torch_ops = lambda: kda_torch_step(x, conv_w, conv_pool, slots, f, A_log, dt_bias, b, state_pool, norm_w, gate)
    timings = [("KDA decode token (after the projections)", per_call_us(torch_ops, repeats), per_call_us(kernel, repeats))]

    h, ones = rand(n, HIDDEN), torch.ones(HIDDEN)
    bank = DenseExpertBank(rand(EXPERTS, INTER, HIDDEN) * 0.05, rand(EXPERTS, INTER, HIDDEN) * 0.05, rand(EXPERTS, HIDDEN, INTER) * 0.05)
    router_w, router_b = rand(EXPERTS, HIDDEN) * 0.05, rand(EXPERTS) * 0.01
    act = functools.partial(glu, kind=Activation.SILU)
    # (name, the op, a call of it with the op's entry): the "c" backend's entry against the torch one (ops/registry.py)
    c_target, torch_target = OpTarget(), OpTarget(c_kernels=False)
    proj = rand(3 * p + D + D + H, HIDDEN) * 0.05  # KDA's fused q|k|v|f_a|g_a|b
    pages = CONTEXT // PAGE
    pool = rand(n * pages + 4, PAGE, RANK + ROPE)
    table = torch.randperm(pool.shape[0], generator=g)[: n * pages].view(n, pages)
    lens = torch.full((n,), CONTEXT)
    q_nope, q_pe = rand(n, MLA_HEADS, NOPE), rand(n, MLA_HEADS, ROPE)
    w_uk, w_uv = rand(MLA_HEADS, NOPE, RANK) * 0.1, rand(MLA_HEADS, V_DIM, RANK) * 0.1
    rows: list[tuple[str, str, str, Callable[[Callable[..., object]], object]]] = [
        (f"projection [{proj.shape[0]}, {HIDDEN}] (linear)", "linear", "fast", lambda fn: fn(h, proj)),
        (f"MLA decode attention, {CONTEXT} tokens", "mla_decode", "auto", lambda fn: fn(q_nope, q_pe, pool, table, lens, w_uk, w_uv, 0.1)),
        ("RMSNorm [n, 256]", "rms_norm", "fast", lambda fn: fn(h, ones, 1e-6)),
        ("router top-2 of 16", "moe_route", "auto", lambda fn: fn(h, router_w, router_b, TOP_K, True, 2.446)),
    ]
    if n > 1:
        idx = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(n)])
        wts = torch.rand(n, TOP_K, generator=g)
        rows.append(("batched routed experts", "moe_experts", "batched", lambda fn: fn(h, idx, wts, bank, act)))
    for name, op_name, impl, call in rows:
        slow, fast = (functools.partial(call, op(op_name, impl, t)) for t in (torch_target, c_target))
        timings.append((name, per_call_us(slow, repeats), per_call_us(fast, repeats)))
    return timings


if __name__ == "__main__":
    main()
