"""Prefill/decode hand-off: a prefix boundary's KDA state and MLA latents leave one engine as a record and enter another.

The protocol (the transport between engines is the caller's): a prefill engine runs the prompt P without its last token
(P[:-1], max_tokens=1, greedy; the sampled token is discarded), so that when it finishes a snapshot at boundary len(P) - 1
exists, and `export_prefix(cache, P[:-1])` returns it as one tier_record. A decode engine's `import_prefix` checks the record
(checksum, and that it fits this engine's cache shape and page size) and puts it in the transfer inbox (inbox.py); the full
request P then hits it through the normal prefix path (CacheManager.match_prefix), computes P[-1] and decodes. The state and
the latents travel in one record, so a hand-off is all or nothing: a refused record leaves nothing behind and the request
recomputes. A record made under another salt (other weights, config or cache dtype of the same shape) is accepted but never
matches, and ages out of the inbox. Engine-thread only, like the rest of the cache.
"""

from __future__ import annotations

from collections.abc import Sequence

from openk3.serve.cache import tier_record
from openk3.serve.cache.hashing import chain_keys, snapshot_key
from openk3.serve.cache.inbox import TransferInbox
from openk3.serve.cache.manager import CacheManager
from openk3.serve.cache.prefix import PrefixCache
from openk3.serve.cache.tier_types import TierEntry, TierKind


def _caches(cache: CacheManager, what: str) -> tuple[PrefixCache, TransferInbox]:
    if cache.prefix is None or cache.inbox is None:
        raise RuntimeError(f"{what} needs prefix caching: build the engine with enable_prefix_caching=True")
    return cache.prefix, cache.inbox


def boundary_key(salt: bytes, tokens: Sequence[int], page_size: int) -> tuple[bytes, bytes, tuple[int, ...]]:
    """(key, anchor, tail) of the snapshot at boundary len(tokens), as the prefix index keys it."""
    k = len(tokens) // page_size
    keys = chain_keys(salt, tokens[: k * page_size], page_size)
    anchor = keys[-1] if keys else salt
    tail = tuple(tokens[k * page_size :])
    return snapshot_key(anchor, tail), anchor, tail


def export_entry(cache: CacheManager, tokens: Sequence[int]) -> TierEntry | None:
    """The snapshot exactly at boundary len(tokens) -- from the device, the host or disk tier, or the inbox -- or None."""
    prefix, inbox = _caches(cache, "export_prefix")
    if not tokens:
        return None
    found = prefix.entry(tokens)
    if found is not None:
        return found
    key, anchor, tail = boundary_key(prefix.salt, tokens, cache.page_size)
    tiers = prefix.tiers
    if tiers is not None and tiers.contains(key):
        for kind in (TierKind.HOST, TierKind.DISK):
            buf = prefix.load_from_tier(kind, key)  # a disk load verifies the file's checksum: a corrupted file is not exported
            if buf is not None:
                return TierEntry(key, anchor, tail, len(tokens), buf)
    return inbox.get(key)


def export_prefix(cache: CacheManager, tokens: Sequence[int]) -> bytes | None:
    """The record of the snapshot at boundary len(tokens) (tier_record format), or None when no tier holds it."""
    e = export_entry(cache, tokens)
    return None if e is None else tier_record.encode(e)


def import_prefix(cache: CacheManager, record: bytes) -> int:
    """Check a record and hold it in the inbox for its request; returns its boundary (tokens). Raises TierRecordError (a
    ValueError) for a corrupted record or one made for a different cache shape, dtype or page size: nothing is stored."""
    _, inbox = _caches(cache, "import_prefix")
    if cache.tensors.copy_log is not None:
        # a record holds one rank's pools; ranks that mirror this one's copies would never receive theirs
        raise RuntimeError("import_prefix: this engine's cache is mirrored on other ranks (tp/ep); hand-offs need a single-rank engine")
    e = tier_record.decode(record)
    tier_record.check_fits(e, cache.tensors)
    inbox.put(e)
    return e.num_tokens
