"""Exact state-machine tests of the prefix index: which pages and snapshots are hit, created and evicted, in which order."""

import pytest
import torch

from openk3.config import debug
from openk3.model.batch import StateCut
from openk3.serve.cache.manager import CacheManager
from openk3.serve.cache.prefix_types import PrefixCacheConfig, PrefixMatch
from openk3.serve.cache.tier_types import TierKind
from openk3.serve.snapshot_points import SnapshotCut

A = list(range(100, 110))  # 10 tokens: pages [100..103] [104..107], tail (108, 109)
B = A + [1, 2, 3]  # 13 tokens: diverges from A's cached run only after it


def manager(snapshots: int = 2, pages: int = 12) -> CacheManager:
    cfg = PrefixCacheConfig(num_snapshot_slots=snapshots, salt=b"test")
    return CacheManager(debug(), num_pages=pages, page_size=4, num_slots=2, prefix=cfg)


def admit(cm: CacheManager, req: str, tokens: list[int]) -> PrefixMatch:
    match = cm.fetch(cm.match_prefix(tokens))
    assert cm.allocate_prefixed(req, tokens, match, len(tokens))
    return match


def refs(cm: CacheManager) -> list[int]:
    return [cm.block_pool.ref_count(p) for p in range(cm.num_pages)]


def test_snapshot_hit_is_copy_on_write_with_exact_pages() -> None:
    cm = manager()
    assert admit(cm, "a", A).num_tokens == 0
    assert cm.page_ids("a") == [0, 1, 2] and cm.slot("a") == 0
    t = cm.tensors
    t.kda_state[0][0].fill_(3.0)
    t.mla_latent[0][2].fill_(5.0)
    assert cm.snapshot("a", A)
    assert cm.prefix is not None and cm.prefix.snapshot_boundaries() == [10]
    assert refs(cm)[:3] == [2, 2, 2]  # request + index (two full pages and the tail page)
    cm.free("a")
    assert refs(cm)[:3] == [1, 1, 1] and cm.num_free_pages == 9
    cm.check_integrity()

    m = admit(cm, "b", B)
    assert (m.num_tokens, m.tier, m.page_ids, m.tail_page, m.slot) == (10, TierKind.DEVICE, (0, 1), 2, 2)
    # full pages shared, tail page copied into the first fresh page (3), snapshot copied into the request's slot
    assert cm.page_ids("b") == [0, 1, 3, 4] and refs(cm)[:5] == [2, 2, 1, 1, 1]
    assert torch.equal(t.kda_state[0][cm.slot("b")], torch.full_like(t.kda_state[0][0], 3.0))
    assert torch.equal(t.mla_latent[0][3], t.mla_latent[0][2])
    assert cm.prefix.counters.hits == 1 and cm.prefix.counters.hit_tokens == 10
    cm.check_integrity()


def test_hit_only_up_to_the_deepest_state_and_branch_point_is_reported() -> None:
    cm = manager()
    admit(cm, "a", A)
    cm.snapshot("a", A)
    cm.free("a")
    diverging = A[:6] + [7, 7, 7, 7, 7]
    m = cm.match_prefix(diverging)
    assert (m.num_tokens, m.tier, m.matched_tokens) == (0, None, 6)  # pages exist up to 6, but no state there: a miss
    same = cm.match_prefix(list(A))  # a hit must leave one token to compute, and there is no state before 10
    assert (same.num_tokens, same.matched_tokens) == (0, 10)
    other_salt = CacheManager(debug(), 12, 4, 2, prefix=PrefixCacheConfig(num_snapshot_slots=2, salt=b"other"))
    assert other_salt.match_prefix(B).num_tokens == 0


def test_slot_pressure_evicts_lru_state_and_keeps_pages_for_deeper_hits() -> None:
    cm = manager(snapshots=2)
    admit(cm, "a", A)
    cm.snapshot("a", A)  # slot 2, boundary 10
    cm.free("a")
    admit(cm, "b", B)  # hit at 10: pages [0, 1, 3, 4]
    cm.snapshot("b", B)  # slot 3, boundary 13: new node for page 3 (108 109 1 2), tail (3,) on page 4
    assert cm.prefix is not None and cm.prefix.snapshot_boundaries() == [10, 13]
    c_tokens = B + [9, 9, 9, 9]
    admit(cm, "c", c_tokens)  # hit at 13; no free request slot is left afterwards
    assert cm.page_ids("c")[:3] == [0, 1, 3]
    cm.free("b")
    cm.snapshot("c", c_tokens)  # needs a snapshot slot: the LRU state (10, an inner one) goes
    assert cm.prefix.snapshot_boundaries() == [13, 17]
    assert cm.prefix.counters.snapshots_evicted == 1
    # the state at 10 is gone but its pages stay (deeper snapshots use them): 10 is a miss, 13 and 17 still hit
    assert cm.match_prefix(A + [9, 9]).num_tokens == 0
    assert cm.match_prefix(B + [5]).num_tokens == 13
    assert cm.match_prefix(c_tokens + [5]).num_tokens == 17
    assert refs(cm)[2] == 0  # A's tail page was only the evicted state's
    cm.free("c")
    cm.check_integrity()


def test_page_pressure_evicts_lru_leaf_and_frees_its_pages_in_order() -> None:
    cm = manager(snapshots=4, pages=6)
    x = [1] * 8 + [2]  # pages [0, 1], tail page 2
    y = [3] * 8 + [4]  # pages [3, 4], tail page 5
    admit(cm, "x", x)
    cm.snapshot("x", x)
    cm.free("x")
    admit(cm, "y", y)
    cm.snapshot("y", y)
    cm.free("y")
    assert cm.num_free_pages == 0 and cm.prefix is not None
    cm.match_prefix(x + [0])  # touches x: y is now the least recently used
    z = [5] * 5
    m = admit(cm, "z", z)  # two pages: y's leaf state goes, freeing tail page 5, then pages 4 and 3 (deepest first)
    assert m.num_tokens == 0
    assert cm.page_ids("z") == [5, 4]
    assert cm.prefix.snapshot_boundaries() == [9]
    assert cm.match_prefix(x + [0]).num_tokens == 9 and cm.match_prefix(y + [0]).num_tokens == 0
    cm.free("z")
    cm.check_integrity()


def test_allocation_failure_changes_nothing() -> None:
    cm = manager(snapshots=2, pages=4)
    admit(cm, "a", A)
    cm.snapshot("a", A)
    before = refs(cm)
    m = cm.match_prefix(B)
    assert not cm.allocate_prefixed("b", B, m, 40)  # 10 pages: more than the pool has, even after evicting everything
    assert refs(cm) == before and not cm.holds("b")
    cm.check_integrity()


def test_integrity_catches_a_leaked_reference() -> None:
    cm = manager()
    admit(cm, "a", A)
    cm.snapshot("a", A)
    cm.block_pool.share([0])
    with pytest.raises(AssertionError, match="page 0"):
        cm.check_integrity()


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="match_unit"):
        PrefixCacheConfig(match_unit=0)
    with pytest.raises(ValueError, match="disk_dir"):
        PrefixCacheConfig(disk_bytes=10)


def fake_engine(**cfg):
    from openk3.serve.engine import EngineConfig, LLMEngine
    from openk3.serve.tokenizer import ByteTokenizer
    from tests.serve.serve_fakes import FakeModel

    base = dict(num_pages=64, page_size=4, max_num_seqs=2, max_model_len=64, enable_prefix_caching=True, num_snapshot_slots=16)
    return LLMEngine(FakeModel(), ByteTokenizer(256), EngineConfig(**{**base, **cfg}))


def run_one(eng, rid: str, prompt: list[int], max_tokens: int = 3) -> list[int]:
    from openk3.serve.sampling import SamplingParams

    start = len(eng.model.calls)
    eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    while eng.has_unfinished():
        eng.step()
        eng.check_integrity()
    return [int(b.seq_lens[0]) for b in eng.model.calls[start:]]


def test_scheduler_cuts_chunks_at_match_units_and_snapshots_there() -> None:
    eng = fake_engine(long_prefill_token_threshold=6, prefix_match_unit=4)
    prompt = list(range(1, 21))
    # chunks of 6 are cut down to multiples of 4; then 2 decode steps; states at every cut, the prompt end and the finish
    assert run_one(eng, "a", prompt) == [4, 4, 4, 4, 4, 1, 1]
    assert eng.cache.prefix.snapshot_boundaries() == [4, 8, 12, 16, 20, 22]
    # hit at 12 (the deepest state), and a's run goes on to 14 where b diverges: a branch-point state there, inside the step
    assert run_one(eng, "b", prompt[:14] + [99]) == [3, 1, 1]
    assert eng.model.calls[-3].state_cuts == (StateCut(0, 2, 8),)  # slots 2..7 hold a's chunk-end states
    assert eng.cache.prefix.snapshot_boundaries() == [4, 8, 16, 20, 22, 12, 14, 15, 17]  # 12 touched by the hit


def test_scheduler_cuts_at_a_detected_branch_point() -> None:
    eng = fake_engine(prefix_match_unit=64)
    shared = list(range(1, 11))
    assert run_one(eng, "a", shared + [50, 51, 52]) == [13, 1, 1]
    assert run_one(eng, "b", shared + [60, 61]) == [12, 1, 1]  # a miss that takes a state at the branch point 10 inside its step
    assert eng.model.calls[-3].state_cuts[0].offset == 10
    assert run_one(eng, "c", shared + [70, 71, 72]) == [3, 1, 1]  # hits 10
    assert eng.stats().prefix_cache.hit_tokens == 10
    # a's prompt again: states at 10 and at 13 (its end); a hit must leave one token, so it starts at 10 and takes one at 12
    assert run_one(eng, "a2", shared + [50, 51, 52]) == [3, 1, 1]
    assert run_one(eng, "a3", shared + [50, 51, 52]) == [1, 1, 1]  # hits 12
    assert eng.stats().prefix_cache.hit_tokens == 10 + 10 + 12


def test_reserved_slots_are_taken_in_lru_order_then_adopted_or_released() -> None:
    cm = manager(snapshots=2)
    admit(cm, "a", A)
    cm.snapshot("a", A)  # slot 2, boundary 10
    assert cm.prefix is not None
    assert cm.reserve_snapshot_slot() == 3  # a free one first
    assert cm.reserve_snapshot_slot() == 2  # then the least recently used snapshot (10) is evicted for its slot
    assert cm.prefix.snapshot_boundaries() == [] and cm.prefix.counters.snapshots_evicted == 1
    assert cm.reserve_snapshot_slot() is None  # every slot reserved: no state to take, nothing breaks
    assert not cm.snapshot("a", A[:6])  # nor does a snapshot at a step's end
    cm.check_integrity()  # reserved slots are neither free nor snapshots
    # the step wrote the states after 4 and 8 tokens into slots 3 and 2: adopted with a's pages
    assert cm.adopt_snapshot("a", A[:8], 3) and cm.adopt_snapshot("a", A[:4], 2)
    assert cm.prefix.snapshot_boundaries() == [8, 4]
    assert refs(cm)[:3] == [2, 2, 1]  # pages 0 and 1 shared with the index, no tail page
    cm.free("a")
    m = cm.match_prefix(A)
    assert (m.num_tokens, m.slot, m.page_ids, m.tail_page) == (8, 3, (0, 1), None)
    assert cm.prefix.snapshot_boundaries() == [4, 8]  # the hit made 8 the most recently used
    assert admit(cm, "b", A[:4] + [9, 9]).num_tokens == 4
    assert cm.reserve_snapshot_slot() == 3  # b's hit at 4 made 8 the least recently used: evicted for its slot
    assert cm.prefix.snapshot_boundaries() == [4]
    assert not cm.adopt_snapshot("b", A[:4], 3)  # a boundary cached already: the slot goes back unused
    assert cm.prefix.snapshot_boundaries() == [4] and cm.reserve_snapshot_slot() == 3
    cm.release_snapshot_slot(3)
    cm.free("b")
    cm.check_integrity()


def test_a_prompt_takes_states_inside_its_prefill_and_its_repeat_hits_on_the_second_send() -> None:
    eng = fake_engine(prefix_match_unit=4, prefix_prompt_snapshots=2)
    prompt = list(range(1, 21))
    assert run_one(eng, "a", prompt) == [20, 1, 1]  # one step: the states at 12 and 16 come out of it, uncut
    assert eng.model.calls[0].state_cuts == (StateCut(0, 12, 3), StateCut(0, 16, 2))  # the deepest two units below 20, slots deepest first
    assert eng.cache.prefix.snapshot_boundaries() == [12, 16, 20, 22]  # + the prompt end and the finish
    # the repeat hits 16 (the last full unit below its end) and takes a branch-point state at 19 in its step: the 3rd hits 19
    assert run_one(eng, "b", prompt) == [4, 1, 1]
    assert eng.model.calls[-3].state_cuts == (StateCut(0, 3, 6),)  # slots 2..5: a's 16, 12, prompt end, finish
    assert eng.stats().prefix_cache.hit_tokens == 16
    # an extension diverging at 18: hit 16, one step with states at the branch point 18 and at the unit 20
    assert run_one(eng, "c", prompt[:18] + [7, 7, 7]) == [5, 1, 1]
    assert eng.model.calls[-3].state_cuts == (StateCut(0, 2, 7), StateCut(0, 4, 8))
    assert eng.cache.prefix.snapshot_boundaries()[-5:] == [16, 18, 20, 21, 23]


def test_a_request_that_ends_while_its_step_runs_gives_its_reserved_slots_back() -> None:
    from openk3.serve.request import RequestStatus
    from openk3.serve.sampling import SamplingParams

    eng = fake_engine(prefix_match_unit=4, prefix_prompt_snapshots=3, num_snapshot_slots=2)
    eng.add_request("a", list(range(1, 21)), SamplingParams(temperature=0, max_tokens=3))
    out = eng.scheduler.schedule()
    assert out.cuts == (SnapshotCut(0, 12, 3), SnapshotCut(0, 16, 2))  # the deepest three would be 8, 12, 16: two slots, deepest first
    eng.scheduler.finish("a", RequestStatus.FINISHED_ABORTED)
    assert eng.scheduler.update_from_output(out, {}) == []
    assert eng.cache.prefix.snapshot_boundaries() == []
    eng.check_integrity()
    assert eng.cache.reserve_snapshot_slot() == 3 and eng.cache.reserve_snapshot_slot() == 2  # free again, in release order
