"""A repeated prompt on its 1st, 2nd and 3rd send: cached tokens and TTFT before (main: KDA states only at step ends) and after
(states also taken inside a prompt's prefill step, `prefix_prompt_snapshots`), and the TTFT of a prompt whose 1k-token prefix
is cached against the TTFT of its uncached suffix alone (issue 42, items 2 and 3).

Model: `LLM("tiny")` (the demo checkpoint when openk3/assets/tiny holds it), fp32, CPU, page size 16, match unit 64, one
request at a time, no chunk limit (a prompt is one prefill step). Each variant runs in its own process, rounds alternating
between them (A B A B ...), and every figure is the median over the rounds. Correctness gate: every variant's greedy tokens
must equal the uncached engine's, else the table says FAIL.

  python benchmarks/prefix_second_send.py                          # main = this tree with prefix_prompt_snapshots=0
  python benchmarks/prefix_second_send.py --main-src /tmp/main-src  # main = another checkout (git worktree add /tmp/main-src main)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import warnings

LENGTHS = (78, 228)
PREFIX, SUFFIX, SUFFIXES = 1024, 64, 3
OUT = 4
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(variant: str, seed: int, threads: int) -> dict:
    """One round of one variant: the measurements as a JSON-able dict."""
    import torch

    from openk3.llm import LLM
    from openk3.serve.sampling import SamplingParams

    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore", message=".*random weights.*")
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=OUT, ignore_eos=True)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, 4000) for _ in range(n)]

    def send(llm: LLM, prompt: list[int]) -> tuple[int, float, list[int]]:
        out = llm.generate([prompt], params)[0]
        metrics = out.outputs[0].metrics
        assert metrics is not None and metrics.time_to_first_token is not None
        return out.num_cached_tokens, metrics.time_to_first_token, list(out.token_ids)

    cfg: dict = dict(max_num_seqs=4, page_size=16, max_model_len=2048)
    if variant != "uncached":
        cfg.update(enable_prefix_caching=True, prefix_match_unit=64)
    if variant == "main-in-tree":
        cfg.update(prefix_prompt_snapshots=0)
    llm = LLM("tiny", **cfg)
    send(llm, ids(300))  # warm-up: first-call costs (weight packing, allocator) out of the figures
    result: dict = {"repeat": {}, "prefix": []}
    for n in LENGTHS:
        prompt = ids(n)
        result["repeat"][str(n)] = [send(llm, prompt) for _ in range(3)]
    for _ in range(SUFFIXES):
        prefix = ids(PREFIX)
        send(llm, prefix + ids(SUFFIX))  # another suffix puts the prefix in the cache
        suffix = ids(SUFFIX)
        result["prefix"].append({"cached": send(llm, prefix + suffix), "suffix_alone": send(llm, suffix)})
    if variant == "uncached":
        llm.engine.check_integrity()
    return result


def first_send_cost(seed: int, threads: int, pairs: int) -> dict:
    """First-send TTFT with the in-step states (default) and without (prefix_prompt_snapshots=0), in one process: fresh
    prompts, the two engines alternating prompt by prompt; {length: [(with, without)] seconds}."""
    import torch

    from openk3.llm import LLM
    from openk3.serve.sampling import SamplingParams

    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore", message=".*random weights.*")
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    cfg: dict = dict(max_num_seqs=4, page_size=16, max_model_len=2048, enable_prefix_caching=True, prefix_match_unit=64)
    engines = [LLM("tiny", **cfg), LLM("tiny", **cfg, prefix_prompt_snapshots=0)]
    out: dict = {}
    for n in (*LENGTHS, PREFIX + SUFFIX):
        rows = []
        for i in range(pairs):
            prompt = [rng.randrange(3, 4000) for _ in range(n)]
            times = [0.0, 0.0]
            for j in (0, 1) if i % 2 == 0 else (1, 0):
                metrics = engines[j].generate([prompt], params)[0].outputs[0].metrics
                assert metrics is not None and metrics.time_to_first_token is not None
                times[j] = metrics.time_to_first_token
            rows.append(times)
        out[str(n)] = rows[1:]  # the first pair warms both engines up
    return out


def run_round(variant: str, seed: int, threads: int, main_src: str | None, extra: list[str] | None = None) -> dict:
    src = main_src if variant == "main" and main_src is not None else ROOT
    env = {**os.environ, "PYTHONPATH": src}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", variant, "--seed", str(seed), "--threads", str(threads), *(extra or [])]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=src)
    if done.returncode != 0:
        raise RuntimeError(f"{variant} round failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def med(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--main-src", default=None, help="a checkout of main to run the 'before' variant from")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--pairs", type=int, default=9, help="prompts per length in the first-send cost table")
    args = parser.parse_args()
    if args.worker == "first-send":
        print(json.dumps(first_send_cost(args.seed, args.threads, args.pairs)))
        return
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.seed, args.threads)))
        return
    before = "main" if args.main_src else "main-in-tree"
    variants = ("uncached", before, "after")
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            runs[v].append(run_round(v, seed=r, threads=args.threads, main_src=args.main_src))
    ref = runs["uncached"]
    cost = run_round("first-send", seed=100, threads=args.threads, main_src=None, extra=["--pairs", str(args.pairs)])

    def same(v: str) -> bool:
        tok = [[s[2] for n in LENGTHS for s in rd["repeat"][str(n)]] + [p["cached"][2] for p in rd["prefix"]] for rd in runs[v]]
        ref_tok = [[s[2] for n in LENGTHS for s in rd["repeat"][str(n)]] + [p["cached"][2] for p in rd["prefix"]] for rd in ref]
        return tok == ref_tok

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    shown = "--main-src <checkout of main>" if args.main_src else ""
    print(f"command: python benchmarks/prefix_second_send.py --rounds {args.rounds} --threads {args.threads} --pairs {args.pairs} {shown}".rstrip())
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, {args.threads} thread(s); commit {commit}")
    print(f"model: LLM('tiny'), fp32, page 16, match unit 64, one prefill step per prompt; medians of {args.rounds} alternating rounds")
    print()
    print("| prompt | variant | cached tokens 1st / 2nd / 3rd send | TTFT 1st / 2nd / 3rd (ms) | 2nd-send TTFT vs 1st |")
    print("|---|---|---|---|---|")
    for n in LENGTHS:
        for v in variants:
            if not same(v):
                print(f"| {n} | {v} | FAIL (tokens differ from uncached) | | |")
                continue
            sends = [[rd["repeat"][str(n)][i] for rd in runs[v]] for i in range(3)]
            cached = " / ".join(str(statistics.median([s[0] for s in send])) for send in sends)
            ttft = [med([s[1] for s in send]) for send in sends]
            print(f"| {n} | {v} | {cached} | {ttft[0]:.1f} / {ttft[1]:.1f} / {ttft[2]:.1f} | {ttft[0] / ttft[1]:.2f}x faster |")
    print()
    print(f"| {PREFIX}-token cached prefix + {SUFFIX}-token suffix | cached tokens | TTFT (ms) | suffix alone, uncached engine (ms) | ratio (goal <= 1.3) |")
    print("|---|---|---|---|---|")
    for v in variants:
        if not same(v):
            print(f"| {v} | FAIL (tokens differ from uncached) | | | |")
            continue
        pairs = [p for rd in runs[v] for p in rd["prefix"]]
        alone = [p["suffix_alone"][1] for rd in ref for p in rd["prefix"]]  # the uncached engine's suffix-alone TTFT
        cached = statistics.median([p["cached"][0] for p in pairs])
        t, a = med([p["cached"][1] for p in pairs]), med(alone)
        print(f"| {v} | {cached} | {t:.1f} | {a:.1f} | {t / a:.2f}x |")
    print()
    print(f"First-send cost of the in-step states: one process, two engines alternating on fresh prompts ({args.pairs - 1} pairs per length)")
    print()
    print("| prompt | TTFT with states inside the step (ms) | without (prefix_prompt_snapshots=0) (ms) | median of per-pair ratios |")
    print("|---|---|---|---|")
    for n, rows in cost.items():
        on, off = med([r[0] for r in rows]), med([r[1] for r in rows])
        print(f"| {n} | {on:.1f} | {off:.1f} | {statistics.median(r[0] / r[1] for r in rows):.3f}x |")


if __name__ == "__main__":
    main()
