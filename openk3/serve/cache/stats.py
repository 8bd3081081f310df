"""Prefix-cache and tier counters for EngineStats and /metrics: hits, snapshots, and bytes used and moved per tier."""

from __future__ import annotations

from dataclasses import dataclass

from openk3.serve.cache.manager import CacheManager, cache_spec
from openk3.serve.cache.tier_types import TierKind, TierStats


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counters since start; `tiers` lists device, then host and disk when configured; `inbox` is the transfer inbox
    (inbox.py), apart because it is no step of the offload chain: it takes only imported hand-offs, each used once."""

    queries: int  # requests looked up
    hits: int  # requests that started from a cached prefix
    query_tokens: int
    hit_tokens: int
    snapshots_taken: int
    snapshots_evicted: int
    tiers: tuple[TierStats, ...]
    inbox: TierStats | None = None
    shared_prefill_waits: int = 0  # (request, step) pairs held back for a running prefill of a shared prefix
    remote_pulls: int = 0  # prefixes imported from another replica (serve/prefix_pull.py), their bytes, and the pulls that failed
    remote_pull_bytes: int = 0
    remote_pull_failures: int = 0
    remote_exports: int = 0  # prefixes exported to another replica

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def all_tiers(self) -> tuple[TierStats, ...]:
        """The tiers, then the inbox: everything /metrics reports per tier."""
        return self.tiers if self.inbox is None else (*self.tiers, self.inbox)

    def tier(self, kind: TierKind) -> TierStats | None:
        return next((t for t in self.all_tiers if t.tier == kind), None)


def prefix_cache_stats(cache: CacheManager) -> PrefixCacheStats | None:
    """None while prefix caching is off. Device bytes: every held page and every used slot (requests' and snapshots');
    device bytes_in counts snapshot and copy-on-write copies on the device."""
    prefix = cache.prefix
    if prefix is None:
        return None
    dtype = cache.tensors.conv_state[0].dtype if cache.tensors.conv_state else cache.tensors.mla_latent[0].dtype
    spec = cache_spec(cache.config, cache.page_size, dtype, cache.fp8_latent)
    page, state = spec.mla.bytes_per_page // cache.tensors.latent_shards, spec.kda.bytes_per_sequence  # this process's share of a page
    used = cache.block_pool.num_used * page + (cache.state_pool.num_used + prefix.num_snapshots) * state
    capacity = cache.num_pages * page + (cache.state_pool.num_slots + len(prefix.all_slots)) * state
    c = prefix.counters
    device = TierStats(TierKind.DEVICE, used, capacity, prefix.num_snapshots, c.device_bytes_copied, 0, c.hits)
    lower = prefix.tiers.stats() if prefix.tiers is not None else ()
    inbox = cache.inbox.stats() if cache.inbox is not None else None
    taken, evicted = c.snapshots_taken, c.snapshots_evicted
    return PrefixCacheStats(
        c.queries,
        c.hits,
        c.query_tokens,
        c.hit_tokens,
        taken,
        evicted,
        (device, *lower),
        inbox,
        c.shared_prefill_waits,
        c.remote_pulls,
        c.remote_pull_bytes,
        c.remote_pull_failures,
        c.remote_exports,
    )
