"""Randomized schedules with prefix caching on a cache-using fake model: `check_integrity()` holds after every step (index,
ref counts, snapshots, slots) and every finished request has exactly the uncached reference tokens."""

import random
from typing import Any

import pytest

from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer
from tests.serve.serve_fakes import FakeModel, reference_greedy

VARIANTS: dict[str, dict[str, Any]] = {
    "device": dict(num_snapshot_slots=3),
    "host": dict(num_snapshot_slots=2, cpu_offload_bytes=2**20),
    "host_small": dict(num_snapshot_slots=1, cpu_offload_bytes=40_000),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_random_schedule_keeps_integrity_and_tokens(seed, variant) -> None:
    rng = random.Random(seed)
    cfg = EngineConfig(
        num_pages=rng.choice([14, 20, 40]),
        page_size=rng.choice([2, 4]),
        max_num_seqs=3,
        max_num_batched_tokens=rng.choice([6, 16, 64]),
        long_prefill_token_threshold=rng.choice([None, 3, 8]),
        max_model_len=28,
        enable_prefix_caching=True,
        prefix_match_unit=rng.choice([2, 4, 8]),
        prefix_snapshot_interval=rng.choice([None, 6]),
        prefix_prompt_snapshots=rng.choice([0, 1, 4]),
        **VARIANTS[variant],
    )
    eng = LLMEngine(FakeModel(), ByteTokenizer(256), cfg)
    stems = [[rng.randrange(256) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    expected: dict[str, list[int]] = {}
    aborted: set[str] = set()
    done: dict[str, list[int]] = {}
    got: dict[str, list[int]] = {}
    steps, next_id = 0, 0
    while next_id < 24 or eng.has_unfinished():
        if next_id < 24 and rng.random() < 0.5:
            stem = rng.choice(stems)
            prompt = stem[: rng.randrange(1, len(stem) + 1)] + [rng.randrange(256) for _ in range(rng.randrange(0, 6))]
            n = rng.randrange(1, 8)
            eng.add_request(str(next_id), prompt, SamplingParams(temperature=0, max_tokens=n))
            expected[str(next_id)] = reference_greedy(prompt, n)
            next_id += 1
        if eng.has_unfinished() and rng.random() < 0.05:
            victim = rng.choice(sorted(eng.scheduler.requests))
            eng.abort(victim)
            aborted.add(victim)
        if eng.has_unfinished():
            for out in eng.step():  # each output carries only the step's new token
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.finished:
                    done[out.request_id] = got[out.request_id]
        eng.check_integrity()
        steps += 1
        assert steps < 2000
    for rid, tokens in done.items():
        assert tokens == expected[rid], rid
    assert set(done) | aborted == set(expected)
    stats = eng.stats().prefix_cache
    assert stats is not None and stats.hits > 0 and stats.snapshots_taken > 0
    eng.close()
