"""Cross-replica prefix pull between two in-process engines (serve/prefix_pull.py): engine A computes a prompt, engine B
pulls the deepest prefix of its own prompt that A holds and serves it from there. Tokens and logprobs equal computing the
prompt (1e-4); hit counts are exact; a record of another model, weights or cache_salt is refused; a holder that evicted the
prefix answers nothing and B computes; a holder still prefilling the prefix answers `pending` until its step is done."""

import dataclasses
import random
from typing import Any

import pytest
import torch

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.serve import prefix_pull
from openk3.serve.cache.tier_record import TierRecordError
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer

PAGE = 64
GEN = SamplingParams(temperature=0, max_tokens=12, logprobs=0)
ENGINE: dict[str, Any] = dict(page_size=PAGE, num_pages=32, max_num_seqs=2, max_model_len=512, prefix_match_unit=PAGE)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def build(seed: int = 5) -> K3ForCausalLM:
    m = K3ForCausalLM(debug())
    m.init_weights(seed=seed)
    return m.eval()


@pytest.fixture(scope="module")
def model() -> K3ForCausalLM:
    return build()


def engine(model: K3ForCausalLM, **cfg: Any) -> LLM:
    return LLM(model, ByteTokenizer(256), **{**ENGINE, "enable_prefix_caching": True, "num_snapshot_slots": 6, **cfg})


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


SYSTEM = ids(200, 1)  # the shared part: holder and puller prompts continue it differently
HOLDER = SYSTEM + ids(60, 2)
PULLER = SYSTEM + ids(50, 3)


def result(llm: LLM, p: list[int], params: SamplingParams = GEN) -> tuple[int, list[int], list[float]]:
    out = llm.generate([p], params)[0]
    lps = out.outputs[0].logprobs
    assert lps is not None
    return out.num_cached_tokens, list(out.token_ids), [lp.logprob for lp in lps]


@pytest.fixture(scope="module")
def computed(model: K3ForCausalLM) -> tuple[list[int], list[float]]:
    llm = LLM(model, ByteTokenizer(256), **ENGINE)  # no prefix caching: the puller's prompt computed in full
    _, tokens, lps = result(llm, PULLER)
    llm.close()
    return tokens, lps


def holder_with(model: K3ForCausalLM, prompt: list[int]) -> LLM:
    a = engine(model)
    a.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    return a


def test_pulled_prefix_gives_the_computed_tokens_and_logprobs(model, computed) -> None:
    a = holder_with(model, HOLDER)
    answer = prefix_pull.export_from(a.engine, PULLER, None, PAGE)
    assert answer.record is not None and not answer.pending
    b = engine(model)
    p = prefix_pull.import_pulled(b.engine.cache, answer.record, PULLER, None)
    assert p == 192  # the deepest of A's prompt snapshots (multiples of the unit) inside the shared 200 tokens
    cached, tokens, lps = result(b, PULLER)
    assert cached == p and tokens == computed[0]
    assert torch.allclose(torch.tensor(lps), torch.tensor(computed[1]), atol=1e-4)
    stats = b.engine.stats().prefix_cache
    assert stats is not None and (stats.remote_pulls, stats.remote_pull_bytes, stats.remote_pull_failures) == (1, len(answer.record), 0)
    assert stats.hits == 1 and stats.hit_tokens == p
    inbox = b.engine.cache.inbox
    assert inbox is not None and len(inbox) == 0  # used once; the device holds it now: a second request hits there
    assert result(b, PULLER)[0] >= p
    holder_stats = a.engine.stats().prefix_cache
    assert holder_stats is not None and holder_stats.remote_exports == 1
    a.engine.check_integrity()
    b.engine.check_integrity()
    a.close()
    b.close()


def test_min_tokens_and_a_prompt_the_holder_does_not_share(model) -> None:
    a = holder_with(model, HOLDER)
    assert prefix_pull.export_from(a.engine, PULLER, None, 193) == prefix_pull.PullAnswer(None, pending=False)
    assert prefix_pull.export_from(a.engine, ids(300, 9), None, PAGE) == prefix_pull.PullAnswer(None, pending=False)
    a.close()


def test_record_of_another_salt_or_model_is_refused(model, computed) -> None:
    a = holder_with(model, HOLDER)
    record = prefix_pull.export_from(a.engine, PULLER, None, PAGE).record
    a.close()
    assert record is not None
    b = engine(model)
    with pytest.raises(TierRecordError, match="another cache_salt"):
        prefix_pull.import_pulled(b.engine.cache, record, PULLER, "tenant-2")
    with pytest.raises(TierRecordError, match="not inside"):
        prefix_pull.import_pulled(b.engine.cache, record, PULLER[:100], None)
    stats = b.engine.stats().prefix_cache
    assert stats is not None and (stats.remote_pulls, stats.remote_pull_failures) == (0, 2)
    b.close()
    other = engine(build(seed=6))  # the same shape, other weights: its salt differs
    with pytest.raises(TierRecordError, match="other weights"):
        prefix_pull.import_pulled(other.engine.cache, record, PULLER, None)
    assert other.engine.cache.inbox is not None and len(other.engine.cache.inbox) == 0
    other.close()


def test_salted_prefix_is_pulled_under_its_salt_only(model) -> None:
    salted = SamplingParams(temperature=0, max_tokens=1, cache_salt="tenant-1")
    a = engine(model)
    a.generate([HOLDER], salted)
    assert prefix_pull.export_from(a.engine, PULLER, None, PAGE).record is None  # the unsalted prompt holds nothing there
    record = prefix_pull.export_from(a.engine, PULLER, "tenant-1", PAGE).record
    assert record is not None
    a.close()
    b = engine(model)
    assert prefix_pull.import_pulled(b.engine.cache, record, PULLER, "tenant-1") == 192
    cached, _, _ = result(b, PULLER, dataclasses.replace(GEN, cache_salt="tenant-1"))
    assert cached == 192
    b.close()


def test_evicted_on_the_holder_falls_back_to_computing(model, computed) -> None:
    a = holder_with(model, HOLDER)
    assert a.engine.cache.prefix is not None
    a.engine.cache.prefix.clear()
    assert prefix_pull.export_from(a.engine, PULLER, None, PAGE) == prefix_pull.PullAnswer(None, pending=False)
    a.close()
    b = engine(model)
    prefix_pull.count_pull_failure(b.engine.cache)  # what the replica does with an empty answer
    cached, tokens, _ = result(b, PULLER)
    assert cached == 0 and tokens == computed[0]
    stats = b.engine.stats().prefix_cache
    assert stats is not None and (stats.remote_pulls, stats.remote_pull_failures) == (0, 1)
    b.close()


def test_a_running_prefill_answers_pending_until_its_step(model) -> None:
    a = engine(model, long_prefill_token_threshold=PAGE)  # one unit per step: the shared part takes several
    a.engine.add_request("holder", HOLDER, SamplingParams(temperature=0, max_tokens=1))
    answers = []
    while a.engine.has_unfinished():
        answers.append(prefix_pull.export_from(a.engine, PULLER, None, 128))
        a.engine.step()
    assert [x.pending for x in answers[:2]] == [True, True]  # 0 then 64 tokens computed: no boundary 128 deep yet
    assert answers[2].record is not None and not answers[2].pending  # after the step that computed 128
    a.engine.check_integrity()
    a.close()
