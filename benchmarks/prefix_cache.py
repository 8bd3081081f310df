"""Prefix caching on the `tiny` model (fp32, CPU): hit rates, reused tokens and TTFT with caching vs without, and the tiers.

(a) prefix_repetition (prefix 1024, suffix 64, 8 prefixes, 64 prompts, one request at a time): token hit rate against the ideal
    prefix/(prefix+suffix) x (1 - prefixes/prompts), and median TTFT with vs without caching. Rows: chunked prefill (chunks of 256,
    snapshots at the 1024 cut) and unchunked (one chunk, so only a detected branch point can give a state at 1024: the second
    request of each prefix misses and snapshots there).
(b) a 6-turn conversation, each turn appending ~100 tokens: cached tokens per turn and TTFT per turn vs no caching.
(c) a working set 4x the device pool (16 prefixes of 512 tokens, 3 rounds; the device holds the pages of 4 and 16 states):
    hit rate and median TTFT device-only vs with the host tier, the disk tier and both, and the bytes moved per tier.
Correctness gate: every cached run's greedy tokens must equal the uncached run's; otherwise the row says FAIL, not a ratio.

  python benchmarks/prefix_cache.py                # the full table (a few minutes on 1 CPU thread)
  python benchmarks/prefix_cache.py --scale 0.25   # every length scaled down, for a quick look
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import subprocess
import tempfile
import warnings

import torch

from openk3.llm import LLM
from openk3.serve.cache.tier_types import TierKind
from openk3.serve.sampling import SamplingParams

VOCAB_LOW, VOCAB_HIGH = 3, 4000
OUT = 4


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def one_by_one(llm: LLM, prompts: list[list[int]], max_tokens: int = OUT) -> tuple[list[list[int]], list[float], list[int]]:
    """Tokens, TTFT and cached tokens of each prompt, sent alone (TTFT without queueing)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens, ttft, cached = [], [], []
    for p in prompts:
        out = llm.generate([p], params)[0]
        tokens.append(list(out.token_ids))
        ttft.append(out.outputs[0].metrics.time_to_first_token or 0.0)
        cached.append(out.num_cached_tokens)
    return tokens, ttft, cached


def make(cached: bool, chunk: int | None, **kw) -> LLM:
    cfg = dict(long_prefill_token_threshold=chunk, max_num_seqs=4)
    if cached:
        cfg.update(enable_prefix_caching=True, prefix_match_unit=64)
    cfg.update(kw)
    return LLM("tiny", **cfg)


def ratio(base: list[float], new: list[float], ok: bool) -> str:
    return f"{statistics.median(base) / statistics.median(new):.1f}x" if ok else "FAIL (tokens differ)"


def workload_a(scale: float, rows: list[str]) -> None:
    prefix_len, suffix_len, num_prefixes, num_prompts = int(1024 * scale), max(1, int(64 * scale)), 8, 64
    rng = random.Random(0)
    prefixes = [ids(rng, prefix_len) for _ in range(num_prefixes)]
    prompts = [prefixes[i % num_prefixes] + ids(rng, suffix_len) for i in range(num_prompts)]
    ideal = prefix_len / (prefix_len + suffix_len) * (1 - num_prefixes / num_prompts)
    total = sum(map(len, prompts))
    for chunk in (max(1, int(256 * scale)), None):
        base_tokens, base_ttft, _ = one_by_one(make(False, chunk), prompts)
        llm = make(True, chunk)
        tokens, ttft, cached = one_by_one(llm, prompts)
        ok = tokens == base_tokens
        label = f"chunks of {chunk}" if chunk else "one chunk (branch points)"
        rows.append(
            f"| a | prefix_repetition, {label} | hit rate {sum(cached) / total:.3f} (ideal {ideal:.3f}) | "
            f"median TTFT {statistics.median(ttft) * 1e3:.0f} ms vs {statistics.median(base_ttft) * 1e3:.0f} ms uncached | "
            f"{ratio(base_ttft, ttft, ok)} |"
        )


def workload_b(scale: float, rows: list[str]) -> None:
    rng = random.Random(1)
    turn_len = max(2, int(100 * scale))
    messages = [ids(rng, turn_len + rng.randrange(-10, 11)) for _ in range(6)]
    results = {}
    for cached in (False, True):
        llm = make(cached, max(1, int(256 * scale)))
        history: list[int] = []
        per_turn = []
        for msg in messages:
            history = history + msg
            toks, ttft, hit = one_by_one(llm, [history], max_tokens=16)
            per_turn.append((len(history), hit[0], ttft[0], toks[0]))
            history = history + toks[0]
        results[cached] = per_turn
    ok = [t[3] for t in results[True]] == [t[3] for t in results[False]]
    for turn, (on, off) in enumerate(zip(results[True], results[False], strict=True), 1):
        prev = results[True][turn - 2][0] + 16 - 1 if turn > 1 else 0  # the previous prompt + its reply but the last token
        rows.append(
            f"| b | 6-turn conversation, turn {turn} | {on[1]} of {on[0]} prompt tokens cached (previous turns: {prev}) | "
            f"TTFT {on[2] * 1e3:.0f} ms vs {off[2] * 1e3:.0f} ms uncached | {ratio([off[2]], [on[2]], ok)} |"
        )


def workload_c(scale: float, rows: list[str]) -> None:
    rng = random.Random(2)
    prefix_len, suffix_len, num_prefixes = int(512 * scale), max(1, int(32 * scale)), 16
    prefixes = [ids(rng, prefix_len) for _ in range(num_prefixes)]
    prompts = [p + ids(rng, suffix_len) for _ in range(3) for p in prefixes]
    page_size = 16
    per_prefix = -(-(prefix_len + suffix_len + OUT) // page_size)
    # the device pool holds the pages of 4 prefixes (plus one running request) and 16 states (a request leaves 4: the 256 cut,
    # the 512 cut, its prompt end and its finish): a working set 4x larger
    device = dict(num_snapshot_slots=16, num_pages=5 * per_prefix + 8, page_size=page_size, max_num_seqs=2)
    chunk = max(1, int(256 * scale))
    base_tokens, base_ttft, _ = one_by_one(make(False, chunk, **device), prompts)
    total = sum(map(len, prompts))
    big = 2**30
    with tempfile.TemporaryDirectory() as tmp:
        setups = {
            "device only": {},
            "+ host tier": dict(cpu_offload_bytes=big),
            "+ disk tier (no host)": dict(disk_offload_dir=tmp, disk_offload_bytes=big),
            "+ host (4 prefixes) + disk": dict(cpu_offload_bytes=0, disk_offload_dir=tmp, disk_offload_bytes=big),
        }
        for name, extra in setups.items():
            if name.startswith("+ host (4"):
                llm0 = make(True, chunk, **device)
                entry = llm0.engine.cache.tensors
                from openk3.serve.cache.transfer import buffer_nbytes

                extra = dict(extra, cpu_offload_bytes=4 * buffer_nbytes(entry, prefix_len + suffix_len + OUT) + 1)
                llm0.close()
            llm = make(True, chunk, **device, **extra)
            tokens, ttft, cached = one_by_one(llm, prompts)
            stats = llm.engine.stats().prefix_cache
            assert stats is not None
            moved = []
            for kind in (TierKind.HOST, TierKind.DISK):
                t = stats.tier(kind)
                if t is not None:
                    moved.append(f"{kind.value}: {t.bytes_in / 2**20:.1f} MiB in, {t.bytes_out / 2**20:.1f} MiB out, {t.hits} hits")
            llm.close()
            ok = tokens == base_tokens
            rows.append(
                f"| c | working set 4x device, {name} | hit rate {sum(cached) / total:.3f} | "
                f"median TTFT {statistics.median(ttft) * 1e3:.0f} ms vs {statistics.median(base_ttft) * 1e3:.0f} ms uncached; "
                f"{'; '.join(moved) or 'no lower tier'} | {ratio(base_ttft, ttft, ok)} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every length (quick runs)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", default="abc", help="which workloads to run (letters)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*random weights.*")
    rows: list[str] = []
    for letter, fn in (("a", workload_a), ("b", workload_b), ("c", workload_c)):
        if letter in args.only:
            fn(args.scale, rows)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"command: python benchmarks/prefix_cache.py --scale {args.scale} --threads {args.threads} --only {args.only}")
    print(f"machine: {platform.machine()} {platform.processor() or ''} torch {torch.__version__}, {args.threads} thread(s); commit {commit}")
    print("model: tiny preset (random weights), fp32, page size 16, match unit 64; one request at a time; TTFT ratio = uncached / cached")
    print()
    print("| | workload | reuse | latency | TTFT speed-up |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
