"""Requests sent together with one new prefix: computed once with the shared-prefill wait, once per request without it.

Two workloads on the demo model with prefix caching on: (a) `--requests` prompts sharing a `--prefix`-token opening
(a system prompt) with short private endings, sent in one `generate` call; (b) the `--requests` samples (n) of one prompt
of that length. Each arm runs on a fresh engine (nothing cached before), arms interleaved `--repeats` times; reported:
prompt tokens served from the cache, the engine's CPU time for the whole call (process time, so other jobs' load counts
less), wall time, and the ratio of the two arms' times in the same round. Greedy outputs of (a) are checked equal between
the arms before a ratio is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

import torch

from openk3.llm import LLM
from openk3.serve.sampling import SamplingParams

TEXT = "In the beginning the old books were copied by hand, and every copy carried the errors of the one before it. "


def workload(llm: LLM, kind: str, prefix: int, requests: int, new: int) -> tuple[list[list[int]], int, int]:
    tok = llm.engine.tokenizer
    opening = tok.encode(TEXT * (prefix // 16 + 1))[:prefix]
    if kind == "shared":
        prompts = [opening + tok.encode(f" Question {i}: what changed in copy number {i}?") for i in range(requests)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new))
        return [list(o.token_ids) for o in outs], sum(o.num_cached_tokens for o in outs), sum(len(p) for p in prompts)
    outs = llm.generate([opening], SamplingParams(temperature=1.0, max_tokens=new, n=requests, seed=0))
    stats = llm.engine.stats().prefix_cache
    assert stats is not None
    return [list(c.token_ids) for c in outs[0].outputs], stats.hit_tokens, requests * len(opening)


def run(kind: str, wait: bool, args: argparse.Namespace) -> tuple[float, float, int, int, list[list[int]]]:
    llm = LLM("tiny", enable_prefix_caching=True, prefix_shared_prefill=wait, max_num_seqs=max(8, args.requests))
    try:
        workload(llm, kind, 64, 1, 1)  # warm-up on an unrelated prompt length (its 64 tokens are no prefix of the rest)
        llm.engine.cache.prefix.clear()  # type: ignore[union-attr]
        c0, w0 = time.process_time(), time.perf_counter()
        tokens, cached, total = workload(llm, kind, args.prefix, args.requests, args.new)
        return time.process_time() - c0, time.perf_counter() - w0, cached, total, tokens
    finally:
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prefix", type=int, default=1024, help="tokens of the shared opening")
    ap.add_argument("--requests", type=int, default=8, help="prompts sent together, and n of the samples workload")
    ap.add_argument("--new", type=int, default=8, help="tokens generated per request")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("THREADS", torch.get_num_threads())))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"command: python benchmarks/shared_prefill.py --prefix {args.prefix} --requests {args.requests} --new {args.new} --repeats {args.repeats}")
    load = os.getloadavg()[0]
    print(f"machine: {os.uname().machine}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}; commit {commit}; load average {load:.1f}")
    print()
    print("| workload | shared-prefill wait | cached / prompt tokens | CPU s (median) | wall s (median) | CPU ratio off / on (median of rounds) |")
    print("|---|---|---:|---:|---:|---:|")
    for kind in ("shared", "samples"):
        rows: dict[bool, list[tuple[float, float, int, int]]] = {True: [], False: []}
        ratios = []
        for _ in range(args.repeats):
            got = {wait: run(kind, wait, args) for wait in (True, False)}
            if kind == "shared" and got[True][4] != got[False][4]:
                raise SystemExit("greedy outputs differ between the arms")
            for wait in (True, False):
                rows[wait].append(got[wait][:4])
            ratios.append(got[False][0] / got[True][0])
        for wait in (True, False):
            r = rows[wait]
            cpu, wall = statistics.median(x[0] for x in r), statistics.median(x[1] for x in r)
            ratio = f"{statistics.median(ratios):.2f}x" if wait else "baseline"
            print(f"| {kind} | {'on' if wait else 'off'} | {r[0][2]} / {r[0][3]} | {cpu:.2f} | {wall:.2f} | {ratio} |")


if __name__ == "__main__":
    main()
