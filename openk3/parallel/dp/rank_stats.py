"""The stats of a data-parallel group as one engine's: every DP rank's EngineStats (each rank reports its own after every
step, channel.py) summed, so the server's /metrics and admission read the whole group as they read one engine.

Counts, pool sizes and running totals add up; the MLA usage is the mean of the ranks' (their pools are the same size);
the prefix-cache counters add up, tier by tier (every rank's engine has the same tiers), the transfer inbox's too.

Expert-parallel stats need no merging: each MoE layer's EPStats already hold every rank's entries (the backends
all-gather them), so rank 0 reports the group's from its own backend, drained once per step (LeaderEPStats; every
leader drains its own, or they would pile up for the life of the server) into an EPTotals (add_ep_step).
"""

from __future__ import annotations

from collections.abc import Sequence

from openk3.model.model import K3ForCausalLM
from openk3.parallel.dp.channel import Outbox
from openk3.parallel.ep.backend import EPBackend, TokenSplit
from openk3.parallel.ep.stats import EPStats
from openk3.parallel.serving.driver import EPDriver, EPTotals, ForwardModel
from openk3.serve.cache.stats import PrefixCacheStats
from openk3.serve.cache.tier_types import TierStats
from openk3.serve.engine_api import EngineStats


def merge_tier_stats(same_tier: Sequence[TierStats]) -> TierStats:
    return TierStats(
        tier=same_tier[0].tier,
        used_bytes=sum(t.used_bytes for t in same_tier),
        capacity_bytes=sum(t.capacity_bytes for t in same_tier),
        entries=sum(t.entries for t in same_tier),
        bytes_in=sum(t.bytes_in for t in same_tier),
        bytes_out=sum(t.bytes_out for t in same_tier),
        hits=sum(t.hits for t in same_tier),
        checksum_failures=sum(t.checksum_failures for t in same_tier),
        dropped=sum(t.dropped for t in same_tier),
    )


def merge_prefix_stats(ranks: Sequence[PrefixCacheStats]) -> PrefixCacheStats:
    kinds = dict.fromkeys(t.tier for r in ranks for t in r.tiers)  # first-seen order: device, then the lower tiers
    inboxes = [r.inbox for r in ranks if r.inbox is not None]
    return PrefixCacheStats(
        queries=sum(r.queries for r in ranks),
        hits=sum(r.hits for r in ranks),
        query_tokens=sum(r.query_tokens for r in ranks),
        hit_tokens=sum(r.hit_tokens for r in ranks),
        snapshots_taken=sum(r.snapshots_taken for r in ranks),
        snapshots_evicted=sum(r.snapshots_evicted for r in ranks),
        tiers=tuple(merge_tier_stats([t for r in ranks for t in r.tiers if t.tier == kind]) for kind in kinds),
        inbox=merge_tier_stats(inboxes) if inboxes else None,
        shared_prefill_waits=sum(r.shared_prefill_waits for r in ranks),
    )


def merge_engine_stats(ranks: Sequence[EngineStats]) -> EngineStats:
    if not ranks:
        raise ValueError("merge_engine_stats: no rank's stats")
    prefix = [r.prefix_cache for r in ranks if r.prefix_cache is not None]
    return EngineStats(
        num_requests_running=sum(s.num_requests_running for s in ranks),
        num_requests_waiting=sum(s.num_requests_waiting for s in ranks),
        kv_cache_usage_perc=sum(s.kv_cache_usage_perc for s in ranks) / len(ranks),
        state_slots_used=sum(s.state_slots_used for s in ranks),
        num_pages=sum(s.num_pages for s in ranks),
        num_free_pages=sum(s.num_free_pages for s in ranks),
        num_state_slots=sum(s.num_state_slots for s in ranks),
        num_preemptions_total=sum(s.num_preemptions_total for s in ranks),
        prompt_tokens_total=sum(s.prompt_tokens_total for s in ranks),
        generation_tokens_total=sum(s.generation_tokens_total for s in ranks),
        prefix_cache=merge_prefix_stats(prefix) if prefix else None,
    )


class LeaderEPStats:
    """A DP leader's expert-parallel stats, one lockstep step at a time (empty when the ranks collect none). With tensor
    parallelism in the group the leader's model is the group's EPDriver, which drains the backend after each forward;
    without, it is the rank's own model, whose MoE layers share the backend."""

    def __init__(self, model: ForwardModel) -> None:
        self._driver = model if isinstance(model, EPDriver) else None
        self._backend: EPBackend | TokenSplit | None = None
        if self._driver is None and isinstance(model, K3ForCausalLM):
            self._backend = next((m.backend for m in model.moe_layers() if isinstance(m.backend, EPBackend | TokenSplit)), None)

    def drain(self) -> list[EPStats]:
        """The step's stats, once the step's forward has run."""
        if self._driver is not None:
            return self._driver.last_stats
        return self._backend.drain_stats() if self._backend is not None else []


def add_ep_step(totals: EPTotals, stats: list[EPStats], boxes: Sequence[Outbox]) -> None:
    """Rank 0: one step's EP stats into the group's totals. A rank whose Outbox has neither outputs nor requests left had
    nothing to run and ran the dummy forward (lockstep.py). A step in which every rank did (rank 0 only delivering the
    end of a remote request) is left out: it ran no request's token, and would overwrite the last real step's gauges."""
    idle = sum(1 for box in boxes if not box.outputs and not box.unfinished)
    if idle < len(boxes):
        totals.add(stats, dummy_forwards=idle)
