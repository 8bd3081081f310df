"""Shared prefill (serve/shared_prefill.py): requests that arrive together with one new prefix compute it once.

On the real K3 model (debug preset, fp32): prompts sharing a prefix sent in one batch start, after the first, from the
cached prefix, with the same tokens (and logprobs within rounding) as without prefix caching; the n samples of one prompt
compute it once; a request that scores its prompt never waits; with no state slot to keep, the requests still finish.
"""

import random
from typing import Any

import pytest
import torch

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.serve.sampling import SamplingParams
from openk3.serve.shared_prefill import common_prefix
from openk3.serve.tokenizer import ByteTokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=4, logprobs=0)
BASE: dict[str, Any] = dict(page_size=4, num_pages=200, max_num_seqs=6, max_model_len=256, long_prefill_token_threshold=24)
CACHED: dict[str, Any] = dict(enable_prefix_caching=True, prefix_match_unit=8, num_snapshot_slots=8)
UNIT = 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model() -> K3ForCausalLM:
    m = K3ForCausalLM(debug())
    m.init_weights(seed=7)
    return m.eval()


def make(model, **cfg) -> LLM:
    return LLM(model, ByteTokenizer(256), **{**BASE, **cfg})


def prompts(seed: int, shared: int = 50, n: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(shared)]
    return [prefix + [rng.randrange(256) for _ in range(rng.randrange(3, 12))] for _ in range(n)]


def waits(llm: LLM) -> int:
    stats = llm.engine.stats().prefix_cache
    assert stats is not None
    return stats.shared_prefill_waits


def results(outs) -> list[tuple[list[int], list[float]]]:
    return [(list(o.token_ids), [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


def same(got, ref) -> bool:
    return [g[0] for g in got] == [r[0] for r in ref] and all(
        torch.allclose(torch.tensor(g[1]), torch.tensor(r[1]), atol=1e-4) for g, r in zip(got, ref, strict=True)
    )


@pytest.mark.parametrize("a,b", [([], [1]), ([1, 2, 3], [1, 2, 3]), (list(range(30)), list(range(17)) + [0] * 5), ([5] * 20, [5] * 19 + [4])])
def test_common_prefix_is_exact(a, b) -> None:
    naive = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    for unit in (1, 4, 8, 64):
        assert common_prefix(a, b, unit) == common_prefix(b, a, unit) == naive


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_requests_sent_together_compute_the_shared_prefix_once(model, policy) -> None:
    batch = prompts(1)
    ref = make(model)
    try:
        expected = results(ref.generate(batch, GREEDY))
    finally:
        ref.close()
    llm = make(model, **CACHED, scheduling_policy=policy)
    try:
        outs = llm.generate(batch, GREEDY)
        llm.engine.check_integrity()
        assert same(results(outs), expected)
        cached = [o.num_cached_tokens for o in outs]
        # the first computes the 50 shared tokens; the others start from its state at the deepest unit below them
        assert cached[0] == 0 and all(c == 48 for c in cached[1:]), cached
        assert waits(llm) >= 3
    finally:
        llm.close()


def test_without_waiting_the_same_batch_misses(model) -> None:
    """The control (--no-prefix-shared-prefill): the requests of one batch compute the shared prefix each."""
    llm = make(model, **CACHED, prefix_shared_prefill=False)
    try:
        outs = llm.generate(prompts(1), GREEDY)
        assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 0]
        assert waits(llm) == 0
    finally:
        llm.close()


def test_n_samples_of_one_prompt_compute_it_once(model) -> None:
    llm = make(model, **CACHED)
    try:
        prompt = prompts(2, shared=40, n=1)[0]
        llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=3, n=4, seed=3))
        stats = llm.engine.stats().prefix_cache
        assert stats is not None
        assert stats.hits == 3 and stats.hit_tokens == 3 * (len(prompt) - 1), stats  # the repeated prompt hits one token short
        llm.engine.check_integrity()
    finally:
        llm.close()


def test_a_request_that_scores_its_prompt_never_waits(model) -> None:
    llm = make(model, **CACHED)
    try:
        batch = prompts(3, n=2)
        params = [GREEDY, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)]
        outs = llm.generate(batch, params)
        assert outs[1].num_cached_tokens == 0 and outs[1].prompt_logprobs is not None
        assert waits(llm) == 0
    finally:
        llm.close()


def test_without_a_free_state_slot_the_batch_still_finishes(model) -> None:
    """One snapshot slot, taken by the first prompt's deepest cut: the held requests are admitted when the prefill has
    passed the shared depth, hit or miss, and every request finishes with the uncached tokens."""
    batch = prompts(4, shared=60, n=5)
    ref = make(model)
    try:
        expected = results(ref.generate(batch, GREEDY))
    finally:
        ref.close()
    llm = make(model, **{**CACHED, "num_snapshot_slots": 1})
    try:
        assert same(results(llm.generate(batch, GREEDY)), expected)
        llm.engine.check_integrity()
    finally:
        llm.close()


def test_a_request_never_waits_for_a_prefill_it_outranks(model) -> None:
    """Priority policy: a low-priority prompt is mid-prefill when a higher-priority one with the same opening arrives. The
    step keeps budget for the higher one (it outranks the running request), so waiting for that prefill would wait for a
    request the step starves: the higher one is admitted at once and computes the opening itself."""
    from openk3.serve.engine import EngineConfig, LLMEngine

    cfg = EngineConfig(**{**BASE, **CACHED}, scheduling_policy="priority", max_num_batched_tokens=24)
    engine = LLMEngine(model, ByteTokenizer(256), cfg)
    low, high = prompts(5, shared=120, n=2)
    greedy = SamplingParams(temperature=0, max_tokens=2, priority=5)
    with torch.inference_mode():
        engine.add_request("low", low, greedy)
        engine.step()  # low's first chunk
        engine.add_request("high", high, SamplingParams(temperature=0, max_tokens=2, priority=0))
        for _ in range(200):
            if not engine.has_unfinished():
                break
            engine.step()
    assert not engine.has_unfinished(), "a request waited for a prefill the scheduler starved"
    engine.check_integrity()
