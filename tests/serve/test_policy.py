"""The scheduling policies (serve/policy.py) with exact steps: a fake runner at the scheduler, the cache-using fake model at the
engine. Steps are the clock: nothing here reads the time."""

import random
from typing import Any

import pytest

from openk3.config import debug
from openk3.serve.cache.manager import CacheManager
from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.policy import SchedulingPolicy
from openk3.serve.request import Request, RequestStatus
from openk3.serve.sampling import SamplingParams
from openk3.serve.scheduler import Scheduler, SchedulerConfig
from openk3.serve.tokenizer import ByteTokenizer
from tests.serve.serve_fakes import FakeModel, reference_greedy
from tests.serve.test_scheduler import fake_run


def make(pages: int, slots: int, policy: str, **cfg: Any) -> Scheduler:
    config = SchedulerConfig(policy=SchedulingPolicy(policy), **cfg)
    return Scheduler(config, CacheManager(debug(), num_pages=pages, page_size=4, num_slots=slots))


def req(rid: str, n: int, priority: int = 0, client: str | None = None) -> Request:
    return Request(rid, [1] * n, SamplingParams(temperature=0, max_tokens=100, priority=priority, client=client))


def test_fcfs_refuses_a_priority_naming_the_flag() -> None:
    s = make(8, 2, "fcfs", max_num_seqs=2)
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        s.add_request(req("a", 3, priority=1))
    s.add_request(req("b", 3, priority=0))
    with pytest.raises(ValueError, match="policy='lifo'"):
        SchedulerConfig(policy="lifo")  # type: ignore[arg-type]


def test_priority_orders_the_queue_and_preempts_larger_values() -> None:
    s = make(32, 2, "priority", max_num_seqs=2, max_num_batched_tokens=64)
    for r in (req("low", 4, 5), req("mid", 4, 3), req("urgent", 4, 0), req("low2", 4, 5)):
        s.add_request(r)
    out = s.schedule()
    assert dict(out.num_scheduled_tokens) == {"urgent": 4, "mid": 4}  # (priority, arrival), two slots
    fake_run(s, out)
    s.add_request(req("urgent2", 4, 0))
    out = s.schedule()  # no free slot: mid (priority 3) gives way, urgent (equal priority) does not
    assert dict(out.num_scheduled_tokens) == {"urgent": 1, "urgent2": 4}
    mid = s.requests["mid"]
    assert mid.status == RequestStatus.PREEMPTED and mid.num_computed_tokens == 0 and s.num_preemptions_total == 1
    s.check_integrity()
    fake_run(s, out)
    s.add_request(req("urgent3", 4, 0))
    out = s.schedule()  # equal priority: it waits its turn (arrival) rather than preempting
    assert dict(out.num_scheduled_tokens) == {"urgent": 1, "urgent2": 1}
    fake_run(s, out)
    s.finish("urgent", RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert dict(out.num_scheduled_tokens) == {"urgent2": 1, "urgent3": 4}  # before mid, which waits with priority 3
    s.check_integrity()


def test_priority_page_shortage_preempts_the_largest_value_not_the_newest() -> None:
    s = make(4, 2, "priority", max_num_seqs=2, max_num_batched_tokens=64)
    s.add_request(req("low", 7, 9))
    fake_run(s, s.schedule())
    s.add_request(req("high", 7, 0))
    out = s.schedule()  # high's prompt takes the last two pages
    assert dict(out.num_scheduled_tokens) == {"low": 1, "high": 7}
    fake_run(s, out)
    out = s.schedule()  # low, first in the batch, needs a third page: fcfs would preempt the newest (high) for it
    assert dict(out.num_scheduled_tokens) == {"high": 1}
    assert s.requests["low"].status == RequestStatus.PREEMPTED
    s.check_integrity()


def test_priority_keeps_the_budget_for_an_urgent_first_chunk() -> None:
    s = make(64, 4, "priority", max_num_seqs=4, max_num_batched_tokens=16)
    s.add_request(req("long", 60, 5))
    out = s.schedule()
    assert dict(out.num_scheduled_tokens) == {"long": 16}
    fake_run(s, out)
    s.add_request(req("urgent", 6, 0))
    out = s.schedule()  # a free slot and pages, but the prefill would take the whole budget: urgent's chunk is kept back
    assert dict(out.num_scheduled_tokens) == {"long": 10, "urgent": 6}
    assert s.num_preemptions_total == 0


def test_fair_turns_between_clients_for_free_slots() -> None:
    s = make(64, 3, "fair", max_num_seqs=3, max_num_batched_tokens=64)
    for i in range(4):
        s.add_request(req(f"a{i}", 2, client="A"))
    s.add_request(req("b0", 2, client="B"))
    s.add_request(req("b1", 2, client="B"))
    out = s.schedule()  # a0 (A has 0), b0 (B has 0, A 1), then A and B both run 1: arrival order gives a1
    assert [r.request_id for r in out.requests] == ["a0", "b0", "a1"]


def test_fair_unnamed_requests_are_clients_of_their_own() -> None:
    s = make(64, 3, "fair", max_num_seqs=3, max_num_batched_tokens=64)
    for i in range(3):  # the n = 3 samples of one caller's request, then a request of one sample
        s.add_request(Request(f"g{i}", [1, 2], SamplingParams(temperature=0, max_tokens=4), group_id="g"))
    s.add_request(Request("single", [1, 2], SamplingParams(temperature=0, max_tokens=4)))
    assert [r.request_id for r in s.schedule().requests] == ["g0", "single", "g1"]


def flood_engine(policy: str) -> LLMEngine:
    cfg = EngineConfig(num_pages=96, page_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, scheduling_policy=policy)
    return LLMEngine(FakeModel(), ByteTokenizer(256), cfg)


FLOOD = [[(7 * i + k) % 256 for k in range(24)] for i in range(10)]
PROBE = [9, 8, 7]


def run_flood(policy: str) -> tuple[int, dict[str, list[int]], int]:
    """Client A's 10 requests of 24 + 40 tokens fill the 4 slots; after 5 steps client B sends a 3-token prompt for 2
    tokens. Returns the steps until B's probe is first scheduled, every request's tokens and the preemptions."""
    eng = flood_engine(policy)
    for i, p in enumerate(FLOOD):
        eng.add_request(f"a{i}", p, SamplingParams(temperature=0, max_tokens=40, client="A"))
    got: dict[str, list[int]] = {}
    steps, waited = 0, None
    while eng.has_unfinished():
        if steps == 5:
            eng.add_request("probe", PROBE, SamplingParams(temperature=0, max_tokens=2, client="B"))
            assert eng.scheduler.num_running == 4  # every slot is A's
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps += 1
        eng.scheduler.check_integrity()
        if waited is None and steps > 5 and eng.was_scheduled("probe") is not False:
            waited = steps - 5
    eng.check_integrity()
    assert waited is not None
    return waited, got, eng.scheduler.num_preemptions_total


def test_fair_admits_another_clients_probe_in_one_step_and_the_flood_keeps_its_tokens() -> None:
    """The bound (serve/policy.py): B runs nothing and A runs every slot, so B's probe ranks first, its first chunk is kept
    out of A's budget and A's newest running request is preempted for its slot: K = 1 step. Under fcfs it waits behind A's
    six queued requests until slots free up: after A's first requests finish their 40 tokens, at the earliest."""
    fair_wait, fair_tokens, preemptions = run_flood("fair")
    fcfs_wait, fcfs_tokens, _ = run_flood("fcfs")
    assert fair_wait == 1 and preemptions >= 1
    assert fcfs_wait > 30
    want = {f"a{i}": reference_greedy(p, 40) for i, p in enumerate(FLOOD)} | {"probe": reference_greedy(PROBE, 2)}
    assert fair_tokens == want and fcfs_tokens == want  # preempted requests recompute to the same tokens


def test_engine_refuses_a_priority_under_fcfs_keeping_nothing() -> None:
    eng = flood_engine("fcfs")
    with pytest.raises(ValueError, match="priority=2 needs priority scheduling"):
        eng.add_request("p", [1, 2, 3], SamplingParams(max_tokens=2, priority=2))
    assert not eng.has_unfinished() and eng.was_scheduled("p") is None
    eng.add_request("p", [1, 2, 3], SamplingParams(temperature=0, max_tokens=2))  # the id was not taken either
    while eng.has_unfinished():
        eng.step()
    eng.check_integrity()


@pytest.mark.parametrize("policy", ["priority", "fair"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_arrivals_under_tight_pages_keep_the_state_rules_and_tokens(policy, seed) -> None:
    """Random priorities, clients and arrival steps on a cache short of pages: every step keeps check_integrity, everything
    finishes, and every request's tokens are the reference's however often it was preempted."""
    rng = random.Random(seed)
    cfg = EngineConfig(num_pages=14, page_size=4, max_num_seqs=3, max_num_batched_tokens=12, max_model_len=40, scheduling_policy=policy)
    eng = LLMEngine(FakeModel(), ByteTokenizer(256), cfg)
    arrivals = sorted((rng.randrange(30), i) for i in range(12))
    prompts = {f"r{i}": [rng.randrange(256) for _ in range(rng.randrange(1, 16))] for _, i in arrivals}
    lengths = {rid: rng.randrange(1, 16) for rid in prompts}
    got: dict[str, list[int]] = {}
    step = 0
    while arrivals or eng.has_unfinished():
        while arrivals and arrivals[0][0] <= step:
            rid = f"r{arrivals.pop(0)[1]}"
            params = SamplingParams(temperature=0, max_tokens=lengths[rid], priority=rng.randrange(3), client=rng.choice(["x", "y", None]))
            eng.add_request(rid, prompts[rid], params)
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        eng.scheduler.check_integrity()
        step += 1
        assert step < 2000, "the schedule did not finish"
    eng.check_integrity()
    assert eng.scheduler.num_preemptions_total > 0
    assert got == {rid: reference_greedy(p, lengths[rid]) for rid, p in prompts.items()}
