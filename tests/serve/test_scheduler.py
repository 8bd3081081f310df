"""The scheduler alone (exact steps with a fake runner) and through the engine with the cache-using fake model."""

from typing import Any

import pytest

from openk3.config import debug
from openk3.serve.cache.manager import CacheManager
from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.request import Request, RequestStatus
from openk3.serve.sampling import SamplingParams
from openk3.serve.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from openk3.serve.tokenizer import ByteTokenizer
from tests.serve.serve_fakes import FakeModel, reference_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=100)


def fake_run(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> list[str]:
    """What a runner would report: a token for each request whose computed tokens catch up this step."""
    sampled = {}
    for rid, n in out.num_scheduled_tokens.items():
        req = sched.requests[rid]
        if req.num_computed_tokens + n == req.num_tokens:
            sampled[rid] = token
    return [r.request_id for r in sched.update_from_output(out, sampled)]


def make(pages: int, slots: int, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), CacheManager(debug(), num_pages=pages, page_size=4, num_slots=slots))


def held(s: Scheduler, out: SchedulerOutput) -> list[tuple[str, int, list[int], int]]:
    """Each scheduled request's id, slot, pages and computed tokens as the runner reads them."""
    return [(r.request_id, s.cache.slot(r.request_id), s.cache.page_ids(r.request_id), r.num_computed_tokens) for r in out.requests]


def test_chunked_prefill_budget_and_plan_exact() -> None:
    s = make(10, 3, max_num_batched_tokens=8, max_num_seqs=2, long_prefill_token_threshold=6)
    for rid, n in (("A", 10), ("B", 3), ("C", 2)):
        s.add_request(Request(rid, list(range(1, n + 1)), GREEDY))

    out = s.schedule()
    assert dict(out.num_scheduled_tokens) == {"A": 6, "B": 2}  # A capped by the chunk size, B by the budget, C by max_num_seqs
    assert held(s, out) == [("A", 0, [0, 1], 0), ("B", 1, [2], 0)]
    assert fake_run(s, out) == []  # nobody caught up yet

    out = s.schedule()
    assert dict(out.num_scheduled_tokens) == {"A": 4, "B": 1}
    assert held(s, out) == [("A", 0, [0, 1, 3], 6), ("B", 1, [2], 2)]
    assert fake_run(s, out) == ["A", "B"]

    out = s.schedule()
    assert dict(out.num_scheduled_tokens) == {"A": 1, "B": 1}  # decode is the same rule: one token behind
    fake_run(s, out)
    s.finish("B", RequestStatus.FINISHED_STOPPED)
    assert s.cache.num_free_pages == 10 - 3  # only A's 3 pages (11 tokens computed) are held now
    out = s.schedule()
    # A decodes while C prefills: one mixed step; B is gone from the plan
    assert dict(out.num_scheduled_tokens) == {"A": 1, "C": 2}
    assert held(s, out)[1][2] == [4]  # B's page 2 went to the back of the free queue
    s.check_integrity()
    for rid in ("A", "C"):
        s.finish(rid, RequestStatus.FINISHED_ABORTED)
    s.check_integrity()
    assert s.cache.num_free_pages == 10 and s.cache.num_free_slots == 3


def test_preemption_frees_newest_and_recomputes() -> None:
    s = make(4, 2, max_num_batched_tokens=64, max_num_seqs=2)
    s.add_request(Request("old", [1] * 7, GREEDY))
    s.add_request(Request("new", [2] * 7, GREEDY))
    fake_run(s, s.schedule())  # each holds 2 pages (7 tokens + the sampled one fit in 8)
    out = s.schedule()
    assert dict(out.num_scheduled_tokens) == {"old": 1, "new": 1}
    fake_run(s, out)
    out = s.schedule()  # both need a third page for token 9; only "old" gets it, "new" is preempted
    assert dict(out.num_scheduled_tokens) == {"old": 1}
    new = s.waiting[0]
    assert new.request_id == "new" and new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert new.num_tokens == 9 and new.num_preemptions == 1 and s.num_preemptions_total == 1
    assert not s.cache.holds("new")
    s.check_integrity()
    fake_run(s, out)
    s.finish("old", RequestStatus.FINISHED_STOPPED)
    out = s.schedule()  # resumed: all 9 tokens (prompt + outputs) recomputed as one prefill
    assert dict(out.num_scheduled_tokens) == {"new": 9}
    assert out.requests[0].token_ids == [2] * 7 + [7, 7] and out.requests[0].num_computed_tokens == 0
    s.check_integrity()


def engine(**cfg: Any) -> LLMEngine:
    base: dict[str, Any] = dict(num_pages=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128)
    base.update(cfg)
    return LLMEngine(FakeModel(), ByteTokenizer(256), EngineConfig(**base))


PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [8], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5, 9, 0, 4, 5, 2], [6, 6, 6, 6]]


def run_all(eng: LLMEngine, prompts, params) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    done: dict[str, list[int]] = {}
    got: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():  # each output carries only the step's new token
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                done[o.request_id] = got[o.request_id]
        eng.scheduler.check_integrity()
    eng.check_integrity()
    assert eng.cache.num_free_pages == eng.cache.num_pages and eng.cache.num_free_slots == eng.cache.state_pool.num_slots
    return done


@pytest.mark.parametrize("chunk", [None, 1, 3, 5, 16])
@pytest.mark.parametrize("budget", [4, 7, 64])
def test_any_chunking_and_budget_gives_the_reference_tokens(chunk, budget) -> None:
    eng = engine(max_num_batched_tokens=budget, long_prefill_token_threshold=chunk)
    done = run_all(eng, PROMPTS, SamplingParams(temperature=0, max_tokens=9))
    assert [done[str(i)] for i in range(len(PROMPTS))] == [reference_greedy(p, 9) for p in PROMPTS]
    assert isinstance(eng.model, FakeModel)
    calls = eng.model.calls
    assert all(int(b.cu_seqlens[-1]) <= budget and b.num_seqs <= 4 for b in calls)
    assert all(int(b.seq_lens.max()) <= (chunk or budget) for b in calls)
    if budget == 64 and chunk == 3:  # a step that decodes some requests while prefilling another
        assert any(not b.is_decode and int(b.seq_lens.min()) == 1 for b in calls)


def test_preemption_under_page_pressure_keeps_tokens_exact() -> None:
    eng = engine(num_pages=12, max_model_len=40, max_num_seqs=4)
    done = run_all(eng, PROMPTS, SamplingParams(temperature=0, max_tokens=20))
    assert eng.scheduler.num_preemptions_total > 0
    assert [done[str(i)] for i in range(len(PROMPTS))] == [reference_greedy(p, 20) for p in PROMPTS]
    stats = eng.stats()
    assert stats.num_preemptions_total == eng.scheduler.num_preemptions_total
    assert (stats.prompt_tokens_total, stats.generation_tokens_total) == (sum(map(len, PROMPTS)), 20 * len(PROMPTS))
    assert (stats.num_requests_running, stats.num_requests_waiting, stats.kv_cache_usage_perc, stats.state_slots_used) == (0, 0, 0.0, 0)


def test_abort_anywhere_frees_everything() -> None:
    eng = engine(max_num_seqs=2, max_num_batched_tokens=8, long_prefill_token_threshold=4)
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=30))
    done: dict[str, list[int]] = {}

    def step() -> None:
        for o in eng.step():  # each output carries only the step's new token
            done.setdefault(o.request_id, []).extend(o.new_token_ids)

    step()
    eng.abort("0")  # running, mid prefill
    eng.abort("3")  # still waiting
    step()
    step()
    eng.abort("2")  # running
    eng.scheduler.check_integrity()
    for aborted in ("0", "2", "3"):
        done.pop(aborted, None)
    while eng.has_unfinished():
        step()
    assert set(done) == {"1"} and done["1"] == reference_greedy(PROMPTS[1], 30)
    eng.check_integrity()
    assert eng.cache.num_free_pages == eng.cache.num_pages and eng.cache.num_free_slots == eng.cache.state_pool.num_slots


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=0)
    with pytest.raises(ValueError, match="max_model_len=1000"):
        engine(num_pages=10, max_model_len=1000)
    eng = engine()
    with pytest.raises(ValueError, match="maximum context length is 128 tokens.* has 128 tokens, which leaves none"):
        eng.add_request("x", [1] * 128)  # a prompt must leave room for the token it samples
    eng.add_request("fits", [1] * 127)
    with pytest.raises(ValueError, match="token id 300: expected ids in 0..255"):
        eng.add_request("y", [300])
    with pytest.raises(ValueError, match="prompt is empty"):
        eng.add_request("z", [])


def test_the_samples_of_one_request_take_turns_with_other_requests() -> None:
    """One caller's n = 6 samples arrive first, two other requests after them: with 4 slots the others are admitted in the
    first step (the samples' group takes turns), not after the whole group; requests of one sample each stay FIFO."""
    s = make(40, 8, max_num_batched_tokens=64, max_num_seqs=4)
    for i in range(6):
        s.add_request(Request(f"{i}_A", [1, 2, 3], GREEDY, group_id="A"))
    s.add_request(Request("B", [1, 2, 3], GREEDY))
    s.add_request(Request("C", [1, 2, 3], GREEDY))
    out = s.schedule()
    assert [r.request_id for r in out.requests] == ["0_A", "B", "C", "1_A"]
    fake_run(s, out)
    s.finish("B", RequestStatus.FINISHED_STOPPED)
    admitted = [r.request_id for r in s.schedule().requests if r.num_computed_tokens == 0]  # nothing computed yet: new this step
    assert admitted == ["2_A"]  # the group's next sample, in arrival order
    fifo = make(40, 8, max_num_batched_tokens=64, max_num_seqs=2)
    for rid in ("X", "Y", "Z"):
        fifo.add_request(Request(rid, [1, 2, 3], GREEDY))
    assert [r.request_id for r in fifo.schedule().requests] == ["X", "Y"]
