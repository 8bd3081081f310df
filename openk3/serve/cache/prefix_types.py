"""The prefix cache's value types: its options (PrefixCacheConfig), the answer to a lookup (PrefixMatch, which the cache
manager also builds for host/disk hits), and its counters (PrefixCounters, read by stats.py). The index is prefix.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openk3.checks import check_int
from openk3.serve.cache.tier_types import TierKind


@dataclass(frozen=True)
class PrefixCacheConfig:
    """Prefix caching options (EngineConfig's enable_prefix_caching and friends, resolved by the engine)."""

    match_unit: int = 64  # prefill chunks are cut at multiples of it, and a state is snapshotted at each such cut
    snapshot_interval: int | None = None  # also cut and snapshot every this many prompt tokens (dense, costs slots)
    # states also taken inside prefill steps, at the deepest this many multiples of match_unit below the prompt's end (the
    # last full unit first), so that a repeated or extended prompt hits on its second send; each costs a snapshot slot
    prompt_snapshots: int = 4
    shared_prefill: bool = True  # a request waits for a running prefill of a prefix it shares (serve/shared_prefill.py)
    num_snapshot_slots: int = 8  # state slots reserved for snapshots, paid from the same cache byte budget as the pages
    salt: bytes = b""  # hashing.model_salt
    host_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("match_unit", "num_snapshot_slots", "prompt_snapshots", "host_bytes", "disk_bytes"):
            check_int("PrefixCacheConfig", name, getattr(self, name), low=1 if name == "match_unit" else 0)
        check_int("PrefixCacheConfig", "snapshot_interval", self.snapshot_interval, low=1, optional=True)
        if self.disk_bytes > 0 and self.disk_dir is None:
            raise ValueError(f"PrefixCacheConfig.disk_bytes={self.disk_bytes} needs disk_dir (a directory for the disk tier)")


@dataclass(frozen=True)
class PrefixMatch:
    """Where a request can start: `num_tokens` tokens are cached in `tier` (None: a miss)."""

    num_tokens: int
    tier: TierKind | None
    key: bytes | None
    page_ids: tuple[int, ...]  # device hit: full pages to share
    tail_page: int | None  # device hit: the page to copy for the tail positions
    slot: int | None  # device hit: the snapshot slot to copy
    matched_tokens: int  # deepest token-level match in the device index, with or without a state
    buffer: torch.Tensor | None = None  # host/disk hit: the loaded prefix (CacheManager.fetch)
    fallback: PrefixMatch | None = None  # host/disk hit: the device match to use if the load fails

    @staticmethod
    def miss(matched_tokens: int = 0) -> PrefixMatch:
        return PrefixMatch(0, None, None, (), None, None, matched_tokens)


@dataclass
class PrefixCounters:
    queries: int = 0
    hits: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    snapshots_taken: int = 0
    snapshots_evicted: int = 0
    shared_prefill_waits: int = 0  # (request, step) pairs held back for a running prefill of a shared prefix (shared_prefill.py)
    device_bytes_copied: int = 0
    remote_pulls: int = 0  # prefixes imported from another replica (serve/prefix_pull.py)
    remote_pull_bytes: int = 0
    remote_pull_failures: int = 0  # pulls that brought nothing: refused, evicted on the holder, or no answer
    remote_exports: int = 0  # prefixes this engine exported to another replica
