"""A data-parallel group's stats read as one engine's: every rank's EngineStats summed, prefix-cache tiers tier by tier."""

from __future__ import annotations

from openk3.parallel.dp.rank_stats import merge_engine_stats
from openk3.serve.cache.stats import PrefixCacheStats
from openk3.serve.cache.tier_types import TierKind, TierStats
from openk3.serve.engine import EngineStats


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
