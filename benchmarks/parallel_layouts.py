"""Offline engine throughput and collectives per step for each multi-rank layout openk3 runs (`LLM(..., tp=, ep=)`, this
process drives, the other ranks are spawned) against one process, same prompts, same run.

Greedy decoding of P prompts x T new tokens (ignore_eos), after one untimed warm-up generate per engine; every process
runs torch with --threads intra-op threads. tok/s = generated tokens / wall time of the timed generate; the ratio is
against the single process of the same run; a layout whose tokens differ from it is reported as MISMATCH, without a
time (in bfloat16, where reduction order changes roundings, the check says how many sequences diverge and where, and
the time is kept). Collectives are counted on rank 0 (every rank issues the same ones) by wrapping torch.distributed's calls, per
model forward, split into the model's (all-reduce, all-gather, all-to-all) and the step channel's broadcasts. With data-
parallel attention (dp2+ep2) each rank runs its own engine over the requests rank 0 places on it: rank 0's counts are
per forward of rank 0 (every rank runs one per step, a dummy when idle), and its step exchange is a scatter and a
gather of objects (counted under neither column).

  python benchmarks/parallel_layouts.py                       # tiny, 4 prompts x 32 tokens, every layout below
  python benchmarks/parallel_layouts.py --model debug --tokens 16
  python benchmarks/parallel_layouts.py --dtype bfloat16 --layouts tp2    # the bf16 divergence rate of TP2
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.serve.sampling import SamplingParams

PROMPTS = [
    "And God said, Let there be light",
    "In the beginning was the Word",
    "The quick brown fox jumps over",
    "Once upon a time, in a land far away,",
] + [f"Prompt number {i}: the story of" for i in range(4, 16)]
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": {"tp": 2},
    "ep2": {"ep": 2},
    "tp2+ep2": {"tp": 2, "ep": 2},
    "dp2+ep2": {"dp": 2, "ep": 2},
    "dp2xtp2+ep4": {"dp": 2, "tp": 2, "ep": 4},  # four ranks: on a 2-core machine each gets half a core
}
COUNTED = ("all_reduce", "all_gather", "all_to_all_single", "broadcast")
calls: collections.Counter[str] = collections.Counter()


def counting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return fn(*args, **kwargs)

    return wrapper


def count_collectives() -> None:
    for name in COUNTED:
        setattr(dist, name, counting(name, getattr(dist, name)))
    K3ForCausalLM.forward = counting("forward", K3ForCausalLM.forward)  # type: ignore[method-assign]


def timed(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[list[list[int]], float, dict[str, int]]:
    try:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        calls.clear()
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        counted = dict(calls)
    finally:
        llm.close()
    return [list(o.outputs[0].token_ids) for o in outs], wall, counted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompts", type=int, default=4, help=f"how many prompts (at most {len(PROMPTS)})")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts {args.prompts}: expected 1..{len(PROMPTS)}")
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")  # a preset without a checkpoint warns about its random weights
    count_collectives()
    prompts = PROMPTS[: args.prompts]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    new_tokens = args.prompts * args.tokens

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    print("command: python " + " ".join(sys.argv))
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} thread(s) per process, commit {commit}")
    print(f"model {args.model} ({args.dtype}), {args.prompts} prompts x {args.tokens} greedy tokens\n")

    want, base, _ = timed(LLM(args.model, dtype=args.dtype), prompts, params)
    header = "| layout | tok/s | vs one process | all-reduce / fwd | all-gather / fwd | all-to-all / fwd | step broadcasts / fwd | check |"
    rows = [f"| one process | {new_tokens / base:.1f} | 1.00 | 0 | 0 | 0 | 0 | reference |"]
    for name in args.layouts:
        got, wall, counted = timed(LLM(args.model, dtype=args.dtype, ep_threads=args.threads, **LAYOUTS[name]), prompts, params)
        forwards = max(counted.get("forward", 0), 1)
        per = [f"{counted.get(c, 0) / forwards:.1f}" for c in COUNTED]
        first = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None) for x, y in zip(want, got, strict=True)]
        diverged = [i for i in first if i is not None]
        if not diverged:
            rows.append(f"| {name} | {new_tokens / wall:.1f} | {base / wall:.2f} | {' | '.join(per)} | tokens equal |")
        elif args.dtype == "float32":
            rows.append(f"| {name} | - | - | {' | '.join(per)} | MISMATCH |")
        else:
            check = f"{len(diverged)}/{len(prompts)} sequences diverge (first at token {min(diverged)})"
            rows.append(f"| {name} | {new_tokens / wall:.1f} | {base / wall:.2f} | {' | '.join(per)} | {check} |")
    print(header)
    print("|" + "---|" * 8)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
