"""KDA prefill: tokens/s of openk3's chunked forms against the per-token recurrence and transformers' pure-PyTorch KDA paths.

Run (after `make venv`, which installs the project):
    .venv/bin/python benchmarks/ops_kda.py [--T 4096] [--heads 4] [--dim 128] [--threads 2] [--repeats 3] [--gate lower_bound|softplus]
    .venv/bin/python benchmarks/ops_kda.py --lengths 2017,31x1 --dim 64     # a packed serving step (cu_seqlens)
Every implementation runs in this process on the same inputs (B=1, fp32, q/k L2-normalised, g from kda_gate), the repeats
round-robin (each repeat runs every row once, so load changes on a shared machine hit all rows alike); min and median are
reported, and the speed-up columns are each row's time over the first row's (kda_chunk_c, the "c" backend's form, where the C
kernels build; else kda_chunk). Speed-ups are printed only if the openk3 chunked forms match kda_recurrent (the definition)
within 1e-4 on the output and the final state; transformers' outputs are checked against the same reference and reported.
With --lengths the tokens are packed sequences (`NxL` is N sequences of L
tokens): kda_chunk runs them through its varlen chunk layout and kda_mixed sends the 1-token ones to the decode kernel, as a
mixed serving step does; transformers' rows are skipped (no packed-sequence entry point there).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from openk3.config import KDAGate
from openk3.ops.cpu.build import kernels_available
from openk3.ops.kda import kda_chunk, kda_gate, kda_recurrent
from openk3.ops.kda.chunk_c import kda_chunk_c
from openk3.ops.kda.mixed import kda_mixed
from openk3.ops.norm import l2_norm

TOLERANCE = 1e-4


def make_inputs(T: int, H: int, D: int, gate: KDAGate) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q = l2_norm(torch.randn(1, T, H, D, generator=gen))
    k = l2_norm(torch.randn(1, T, H, D, generator=gen))
    v = torch.randn(1, T, H, D, generator=gen)
    f = torch.randn(1, T, H, D, generator=gen)
    dt_bias = torch.randn(H * D, generator=gen)
    if gate == KDAGate.SOFTPLUS:
        g = kda_gate(f, torch.empty(H).uniform_(1, 16, generator=gen).log(), dt_bias, gate)
    else:
        g = kda_gate(f, torch.zeros(H), dt_bias, gate, lower_bound=-5.0)
    beta = torch.sigmoid(torch.randn(1, T, H, generator=gen))
    return q, k, v, g, beta


def timed_runs(runs: dict[str, Callable[[], tuple]], repeats: int, clock: Callable[[], float]) -> tuple[dict[str, list[float]], dict[str, tuple]]:
    """Every time per implementation; the repeats go round-robin so load changes on a shared machine hit all rows alike."""
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    outputs: dict[str, tuple] = {}
    for _ in range(repeats):
        for name, fn in runs.items():
            start = clock()
            outputs[name] = fn()
            seconds[name].append(clock() - start)
    return seconds, outputs


def chunked_forms(cu: torch.Tensor | None = None) -> dict[str, Callable[[tuple], tuple]]:
    """openk3's chunked prefill forms, the "c" backend's first where it builds."""
    forms: dict[str, Callable[[tuple], tuple]] = {}
    if kernels_available():
        forms["openk3 kda_chunk_c (C kernels)"] = lambda x: kda_chunk_c(*x, cu_seqlens=cu)
    forms["openk3 kda_chunk (torch)"] = lambda x: kda_chunk(*x, cu_seqlens=cu)
    return forms


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {torch.get_num_threads()} torch threads"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128, help="dk = dv")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per implementation (min and median are reported)")
    parser.add_argument("--gate", default="lower_bound", choices=[g.value for g in KDAGate])
    parser.add_argument("--lengths", default=None, help="packed sequence lengths, e.g. 2017,31x1 (overrides --T)")
    parser.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "cpu"],
        help="wall: latency; cpu: this process's CPU time, steadier on a loaded machine (meaningful with --threads 1)",
    )
    args = parser.parse_args()
    lengths = parse_lengths(args.lengths) if args.lengths else None
    if lengths:
        args.T = sum(lengths)
    torch.set_num_threads(args.threads)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"machine: {machine()}; torch {torch.__version__}; commit {commit}")
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs (a shared machine slows the many-op loops most)")
    packed = f" packed {args.lengths} ({len(lengths)} sequences)" if lengths else ""
    print(f"B=1 T={args.T}{packed} H={args.heads} dk=dv={args.dim} fp32 gate={args.gate} clock={args.clock}, {args.repeats} round-robin repeats\n")

    inputs = make_inputs(args.T, args.heads, args.dim, KDAGate(args.gate))
    if lengths:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        zero = torch.zeros(len(lengths), args.heads, args.dim, args.dim)
        runs: dict[str, Callable[[tuple], tuple]] = {
            **chunked_forms(cu),
            "openk3 kda_mixed (1-token sequences to kda_decode)": lambda x: kda_mixed(*x, initial_state=zero, cu_seqlens=cu),
            "openk3 kda_recurrent (reference)": lambda x: kda_recurrent(*x, cu_seqlens=cu),
        }
        for fn in runs.values():
            fn(inputs)
        return report(args, runs, inputs)
    warm = tuple(x[:, :256] for x in inputs)
    runs = {**chunked_forms(), "openk3 kda_recurrent (reference)": lambda x: kda_recurrent(*x)}
    try:
        from transformers.models.kimi_linear import modeling_kimi_linear as kl

        runs["transformers recurrent_kimi_delta_attention"] = lambda x: kl.recurrent_kimi_delta_attention(*x, initial_state=None, output_final_state=True)
        runs["transformers chunk_kimi_delta_attention"] = lambda x: kl.chunk_kimi_delta_attention(*x, initial_state=None, output_final_state=True)
    except ImportError as err:
        print(f"transformers' kimi_linear not available ({err}); its rows are skipped\n")

    for fn in runs.values():
        fn(warm)
    return report(args, runs, inputs)


def parse_lengths(spec: str) -> list[int]:
    """'2017,31x1' -> [2017, 1, 1, ..., 1] (31 ones)."""
    out: list[int] = []
    for part in spec.split(","):
        count, _, length = part.rpartition("x")
        out.extend([int(length)] * (int(count) if count else 1))
    return out


def report(args: argparse.Namespace, runs: dict[str, Callable[[tuple], tuple]], inputs: tuple) -> int:
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    seconds, outputs = timed_runs({name: (lambda fn=fn: fn(inputs)) for name, fn in runs.items()}, args.repeats, clock)
    low = {name: min(times) for name, times in seconds.items()}
    mid = {name: statistics.median(times) for name, times in seconds.items()}

    print(f"load average after: {os.getloadavg()[0]:.1f}\n")
    o_ref, s_ref = outputs["openk3 kda_recurrent (reference)"]
    errors = {name: max((o - o_ref).abs().max().item(), (s - s_ref).abs().max().item()) for name, (o, s) in outputs.items()}
    ours = next(iter(runs))
    head = f"| implementation | min {args.clock} s | median {args.clock} s | tokens/s (min) | x first row (min) | x first row (median)"
    print(head + " | max abs err vs reference |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in runs:
        print(
            f"| {name} | {low[name]:.4f} | {mid[name]:.4f} | {args.T / low[name]:,.0f} | {low[name] / low[ours]:.1f}x | {mid[name] / mid[ours]:.1f}x"
            f" | {errors[name]:.1e} |"
        )
    bad = {name: err for name, err in errors.items() if name.startswith("openk3") and err >= TOLERANCE}
    if bad:
        print(f"\nREFUSED: {bad} differ from the reference by >= {TOLERANCE}; no speed-up is claimed")
        return 1
    print()
    for base in [n for n in runs if n.startswith("openk3 kda_chunk")]:
        for name in runs:
            if name != base:
                print(f"{base} vs {name}: {low[name] / low[base]:.1f}x (min), {mid[name] / mid[base]:.1f}x (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
