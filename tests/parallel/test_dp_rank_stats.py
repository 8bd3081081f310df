"""A data-parallel group's stats read as one engine's: every rank's EngineStats summed, prefix-cache tiers tier by tier;
its expert-parallel stats drained from a leader's backend each step (with or without tensor parallelism in the group)
and added to rank 0's totals with the ranks that ran the dummy forward."""

from __future__ import annotations

import pytest
import torch

from openk3.config import debug
from openk3.model import K3ForCausalLM
from openk3.parallel.dp.channel import Outbox
from openk3.parallel.dp.lockstep import LockstepModel
from openk3.parallel.dp.rank_stats import LeaderEPStats, add_ep_step, merge_engine_stats
from openk3.parallel.ep.backend import attach_expert_parallel
from openk3.parallel.ep.stats import EPStats
from openk3.parallel.group import ParallelContext
from openk3.parallel.serving.driver import EPDriver, EPTotals, ForwardModel
from openk3.serve.cache.stats import PrefixCacheStats
from openk3.serve.cache.tier_types import TierKind, TierStats
from openk3.serve.engine_api import EngineStats
from openk3.serve.request import EngineCoreOutput
from tests.parallel.test_ep_failure import RecordingChannel


def rank(running: int, free_pages: int, tiers: tuple[TierStats, ...] | None, inbox: TierStats | None = None) -> EngineStats:
    prefix = None if tiers is None else PrefixCacheStats(4, 1, 100, 60 + running, 2, 1, tiers, inbox)
    return EngineStats(running, 1, (100 - free_pages) / 100, running, 100, free_pages, 8, 3, 50, 20, prefix)


def test_counts_pools_and_totals_add_up() -> None:
    merged = merge_engine_stats([rank(2, 90, None), rank(5, 70, None)])
    assert (merged.num_requests_running, merged.num_requests_waiting, merged.state_slots_used) == (7, 2, 7)
    assert (merged.num_pages, merged.num_free_pages, merged.num_state_slots) == (200, 160, 16)
    assert (merged.num_preemptions_total, merged.prompt_tokens_total, merged.generation_tokens_total) == (6, 100, 40)
    assert abs(merged.kv_cache_usage_perc - 0.2) < 1e-12  # 40 of 200 pages held
    assert merged.prefix_cache is None


def test_prefix_tiers_add_up_tier_by_tier() -> None:
    device = TierStats(TierKind.DEVICE, 10, 100, 1, 5, 0, 2)
    host = TierStats(TierKind.HOST, 7, 50, 2, 3, 1, 1, checksum_failures=1)
    inbox = TierStats(TierKind.INBOX, 0, 64, 0, 30, 30, 1, dropped=2)
    merged = merge_engine_stats([rank(1, 99, (device, host), inbox), rank(1, 99, (device,), inbox)])
    prefix = merged.prefix_cache
    assert prefix is not None
    assert (prefix.queries, prefix.hits, prefix.query_tokens, prefix.hit_tokens) == (8, 2, 200, 122)
    assert [t.tier for t in prefix.tiers] == [TierKind.DEVICE, TierKind.HOST]
    assert prefix.tier(TierKind.DEVICE) == TierStats(TierKind.DEVICE, 20, 200, 2, 10, 0, 4)
    assert prefix.tier(TierKind.HOST) == host  # one rank had a host tier
    assert prefix.inbox == TierStats(TierKind.INBOX, 0, 128, 0, 60, 60, 2, dropped=4)


@pytest.mark.parametrize("tp", [1, 2], ids=["model", "ep-driver"])
def test_a_leader_drains_its_backend_once_per_step(tp: int) -> None:
    """tp=1: the leader's model is the rank's own, its backend drained by the leader; tp>1: the group's EPDriver drains it
    after each forward. Either way the step's stats come out once (the dummy forward's: 1 token, top_k entries per MoE
    layer) and nothing is left to pile up."""
    model = K3ForCausalLM(debug())
    model.init_weights(0)
    backend = attach_expert_parallel(model, ParallelContext.single(), "ep", collect_stats=True)
    forward: ForwardModel = model if tp == 1 else EPDriver(model, RecordingChannel(), backend)  # type: ignore[arg-type]
    lockstep = LockstepModel(forward, torch.device("cpu"))
    leader = LeaderEPStats(lockstep.model)
    for _ in range(2):
        lockstep.end_step()  # the engine ran nothing: the dummy forward
        stats = leader.drain()
        assert [s.layer_index for s in stats] == [m.layer_index for m in model.moe_layers()]
        assert all(s.recv_entries_R == (debug().moe.num_experts_per_token,) for s in stats)
        assert backend.drain_stats() == []


def ep_stats(layer: int, entries: tuple[int, ...]) -> EPStats:
    return EPStats(layer, "ep", entries, entries, max(entries) / (sum(entries) / len(entries)), 0.5, 100, 0, 0, 0.0, 0.0)


def box(outputs: int, unfinished: int) -> Outbox:
    out = EngineCoreOutput("r", (1,), None, 0, finish_reason="length")
    return Outbox((out,) * outputs, rank(0, 100, None), unfinished)


def test_ep_steps_count_idle_ranks_and_skip_a_step_no_rank_ran_tokens() -> None:
    totals = EPTotals()
    add_ep_step(totals, [ep_stats(1, (6, 2))], [box(1, 1), box(1, 1)])  # both ranks ran requests' tokens
    add_ep_step(totals, [ep_stats(1, (4, 4))], [box(0, 1), box(0, 0)])  # rank 0 mid-prefill, rank 1 idle: one dummy
    add_ep_step(totals, [ep_stats(1, (3, 5))], [box(0, 0), box(1, 0)])  # rank 1's last token, rank 0 idle
    assert (totals.steps, totals.dummy_forwards, totals.recv_entries_R, totals.bytes_sent) == (3, 2, [13, 11], 300)
    # rank 0 only ending a remote request: every rank ran the dummy, nothing is reported, the gauges keep the last step
    add_ep_step(totals, [ep_stats(1, (4, 0))], [box(0, 0), box(0, 0)])
    assert (totals.steps, totals.dummy_forwards, totals.recv_entries_R) == (3, 2, [13, 11])
    assert totals.last[1].recv_entries_R == (3, 5)
