"""Cross-replica prefix pull, the engine's side: a replica that lacks a prefix another replica holds imports that one's
cached state (MLA latents of the prefix and the KDA snapshot at its boundary) instead of computing it.

The holder answers `export_for_peer(tokens, cache_salt, min_tokens)` with the deepest boundary of `tokens` it holds in any
tier (device, host, disk, or its transfer inbox), under the request's salt, as one checksummed tier record (tier_record.py)
-- or, when it holds none at least `min_tokens` deep but one of its prompts (running or waiting) will prefill a prefix of
`tokens` that deep, with `pending=True`: the caller asks again after the next step (scale/prefix_pull.py), as a waiting request
does for a shared prefill in one engine (shared_prefill.py). The puller's `import_pulled(record, tokens, cache_salt)`
checks the record (checksum, cache shape and page size, as a prefill hand-off) and, beyond what a hand-off is checked
for, that its key is the key of that prefix of *its own* request under *its own* salt: a record made by another model,
other weights, another cache dtype or another `cache_salt` never enters the inbox (a hand-off of another salt only never
matches). Accepted, it waits in the transfer inbox (inbox.py) for the request, which hits it through the normal prefix
path; its size is bounded by the prompt (check_fits: exactly the bytes of its boundary, which is inside the prompt).
Counts (prefix_types.PrefixCounters, /metrics `prefix_cache_remote_*`): pulls imported and their bytes, pulls that failed
(refused records, and what the caller reports: a holder that had evicted it, or could not be reached), exports answered.
Engine thread only, like the cache (AsyncEngine.call).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from openk3.serve.cache import tier_record
from openk3.serve.cache.handoff import boundary_key
from openk3.serve.cache.hashing import request_salt
from openk3.serve.cache.manager import CacheManager
from openk3.serve.cache.prefix import PrefixCache
from openk3.serve.cache.tier_record import TierRecordError
from openk3.serve.cache.tier_types import TierEntry, TierKind
from openk3.serve.cache.transfer import pack
from openk3.serve.engine import LLMEngine
from openk3.serve.request import Request
from openk3.serve.shared_prefill import common_prefix, unfinished_prefills


@dataclass(frozen=True)
class PullAnswer:
    """A holder's answer: a record (its boundary is in the record), or none, with `pending` when a prefill (running or waiting) of
    this engine is computing a prefix of the tokens at least `min_tokens` deep (asking again after a step may find it)."""

    record: bytes | None
    pending: bool = False


def _prefix(cache: CacheManager, what: str) -> PrefixCache:
    if cache.prefix is None or cache.inbox is None:
        raise RuntimeError(f"{what} needs prefix caching: build the engine with enable_prefix_caching=True")
    if cache.tensors.copy_log is not None:
        # a record holds one rank's pools; ranks that mirror this one's copies would never send or receive theirs
        raise RuntimeError(f"{what}: this engine's cache is mirrored on other ranks (tp/ep); prefix pulls need single-rank engines")
    return cache.prefix


def deepest_entry(cache: CacheManager, tokens: list[int], cache_salt: str | None) -> TierEntry | None:
    """The deepest boundary (at most len(tokens) - 1) of `tokens` that any tier holds under the request's salt, packed."""
    prefix = _prefix(cache, "export_for_peer")
    match = cache.fetch(cache.match_prefix(tokens, cache_salt))
    p = match.num_tokens
    if p == 0:
        return None
    key, anchor, tail = boundary_key(request_salt(prefix.salt, cache_salt), tokens[:p], cache.page_size)
    assert key == match.key, "the prefix index keys a boundary as handoff.boundary_key does"
    if match.tier == TierKind.DEVICE:
        assert match.slot is not None
        pages = [*match.page_ids, *([match.tail_page] if match.tail_page is not None else [])]
        return TierEntry(key, anchor, tail, p, pack(cache.tensors, match.slot, pages, p))
    assert match.buffer is not None
    return TierEntry(key, anchor, tail, p, match.buffer)


def prefilling_toward(requests: Sequence[Request], tokens: Sequence[int], cache_salt: str | None, depth: int, unit: int) -> bool:
    """Whether a prompt of this salt, running or waiting, not yet computed `depth` tokens deep, shares at least `depth` tokens with
    `tokens` (its prefill will leave a snapshot there or close below: prompt snapshots, shared-prefill cuts)."""
    for r in unfinished_prefills(requests):
        if r.cache_salt == cache_salt and r.num_computed_tokens < depth:
            if common_prefix(tokens, r.cache_key_ids(r.num_prompt_tokens), unit) >= depth:
                return True
    return False


def export_for_peer(cache: CacheManager, requests: Sequence[Request], tokens: list[int], cache_salt: str | None, min_tokens: int, unit: int) -> PullAnswer:
    """The holder's side (module docstring). `requests`: the scheduler's running and waiting ones; `unit`: the match unit."""
    e = deepest_entry(cache, tokens, cache_salt)
    assert cache.prefix is not None
    if e is not None and e.num_tokens >= min_tokens:
        cache.prefix.counters.remote_exports += 1
        return PullAnswer(tier_record.encode(e))
    return PullAnswer(None, prefilling_toward(requests, tokens, cache_salt, max(min_tokens, 1), unit))


def import_pulled(cache: CacheManager, record: bytes, tokens: list[int], cache_salt: str | None) -> int:
    """The puller's side: check `record` against this engine and the prefix of `tokens` it claims, and hold it in the
    transfer inbox for the request; returns its boundary. Raises TierRecordError (a ValueError) when it is corrupted, made
    for another cache shape or page size, or not this request's prefix under this engine's salt; nothing is stored then."""
    prefix = _prefix(cache, "import_pulled")
    try:
        e = tier_record.decode(record)
        tier_record.check_fits(e, cache.tensors)
        if not 0 < e.num_tokens < len(tokens):
            raise TierRecordError(f"pulled prefix record: boundary {e.num_tokens} is not inside the {len(tokens)}-token prompt")
        key, _, _ = boundary_key(request_salt(prefix.salt, cache_salt), tokens[: e.num_tokens], cache.page_size)
        if e.key != key:
            raise TierRecordError(
                "pulled prefix record: its key is not this prompt's prefix under this engine's salt "
                "(another model, other weights, another cache dtype or another cache_salt made it)"
            )
        assert cache.inbox is not None
        cache.inbox.put(e)
    except ValueError:  # TierRecordError, or an inbox too small for it
        prefix.counters.remote_pull_failures += 1
        raise
    prefix.counters.remote_pulls += 1
    prefix.counters.remote_pull_bytes += len(record)
    return e.num_tokens


def count_pull_failure(cache: CacheManager) -> None:
    """A pull that brought nothing (the holder had evicted the prefix, or did not answer): the request computes it."""
    _prefix(cache, "count_pull_failure").counters.remote_pull_failures += 1


def export_from(engine: LLMEngine, tokens: list[int], cache_salt: str | None, min_tokens: int) -> PullAnswer:
    """`export_for_peer` on an engine's cache, its running and waiting requests and match unit (what a replica runs on its engine thread)."""
    requests = [*engine.scheduler.running, *engine.scheduler.waiting]
    return export_for_peer(engine.cache, requests, tokens, cache_salt, min_tokens, engine.config.prefix_match_unit)
