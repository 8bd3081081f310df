"""Offline engine throughput expert-parallel (`LLM(..., ep=N)`, this process drives, N - 1 spawned workers) against one
process, same prompts, same run.

Greedy decoding of P prompts x T new tokens (ignore_eos), after one untimed warm-up generate per engine. Every process runs
torch with --threads intra-op threads (one process: --threads; ep=N: --threads per rank). tok/s = generated tokens / wall
time of the timed generate. The ratio is against the single process of the same run; a method whose tokens differ from the
single process's is reported as MISMATCH, without a time. eplb places its replicas from the expert load the single
process measured on the same prompts (an untimed run with export_eplb_stats).

  python benchmarks/ep_engine.py                                  # tiny, 4 prompts x 32 tokens, ep=2, ep/moonep/eplb
  python benchmarks/ep_engine.py --model debug --tokens 16 --methods ep
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from openk3.llm import LLM
from openk3.serve.sampling import SamplingParams

PROMPTS = [
    "And God said, Let there be light",
    "In the beginning was the Word",
    "The quick brown fox jumps over",
    "Once upon a time, in a land far away,",
]


def timed(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[list[list[int]], float]:
    try:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
    finally:
        llm.close()
    return [list(o.outputs[0].token_ids) for o in outs], wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompts", type=int, default=4, help=f"how many prompts (at most {len(PROMPTS)})")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--methods", nargs="+", default=["ep", "moonep", "eplb"], choices=["ep", "moonep", "eplb"])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    args = parser.parse_args()
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts {args.prompts}: expected 1..{len(PROMPTS)}")
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")  # a preset without a checkpoint warns about its random weights
    prompts = PROMPTS[: args.prompts]
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    new_tokens = args.prompts * args.tokens

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    print("command: python " + " ".join(sys.argv))
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} thread(s) per process, commit {commit}")
    print(f"model {args.model}, {args.prompts} prompts x {args.tokens} greedy tokens, ep={args.ep}\n")

    stats = Path(tempfile.mkdtemp(prefix="openk3-ep-engine-")) / "load.json"
    if "eplb" in args.methods:  # an untimed run of its own, so the reference pays nothing for the counting
        with LLM(args.model, export_eplb_stats=str(stats)) as measuring:
            measuring.generate(prompts, params)
    want, base = timed(LLM(args.model), prompts, params)
    rows = [("one process", f"{new_tokens / base:.1f}", "1.00", "reference")]
    for method in args.methods:
        placed = {"eplb_stats": str(stats)} if method == "eplb" else {}
        got, wall = timed(LLM(args.model, ep=args.ep, ep_method=method, ep_threads=args.threads, **placed), prompts, params)
        if got != want:
            rows.append((f"ep={args.ep} {method}", "-", "-", "MISMATCH"))
        else:
            rows.append((f"ep={args.ep} {method}", f"{new_tokens / wall:.1f}", f"{base / wall:.2f}", "tokens equal"))
    print(f"| {'engine':<14} | {'tok/s':>7} | {'vs one process':>14} | check |")
    print(f"|{'-' * 16}|{'-' * 9}|{'-' * 16}|-------|")
    for name, rate, ratio, check in rows:
        print(f"| {name:<14} | {rate:>7} | {ratio:>14} | {check} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
