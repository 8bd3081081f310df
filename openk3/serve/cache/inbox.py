"""TransferInbox: prefixes a decode engine imported from a prefill engine, held on the host until their request arrives.

Why a tier of its own rather than the host tier: an imported prefix is a hand-off for one request that is about to arrive, not a
cache entry that earned its place by being reused. So it is exclusive and used once: the request that hits it moves it onto the
device (where the device index snapshots it again and the normal LRU and offload rules take over) and the inbox lets it go
(`discard`). It never receives offloads and never offloads itself: a record whose request never comes (cancelled, routed
elsewhere, another model's salt) ages out by LRU within a byte budget, and its request, if it does come later, recomputes.
It is always there when prefix caching is on, so a decode engine needs no host tier configured to take hand-offs.
Not thread-safe: the engine thread owns it, like the prefix index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from openk3.serve.cache.hashing import snapshot_key
from openk3.serve.cache.tier_types import TierEntry, TierKind, TierStats
from openk3.serve.cache.tiers import HostTier


class TransferInbox:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"TransferInbox.capacity_bytes={capacity_bytes} is invalid: expected >= 1")
        self.store = HostTier(capacity_bytes)  # the byte budget, LRU order and anchor index; the rules above are this class's
        self.dropped = 0  # entries aged out unused: a hand-off that was wasted (its request recomputes, if it comes)

    @property
    def capacity_bytes(self) -> int:
        return self.store.capacity_bytes

    @capacity_bytes.setter
    def capacity_bytes(self, value: int) -> None:  # the budget is not in EngineConfig yet: set here (it applies to later puts)
        self.store.capacity_bytes = value

    @property
    def entries(self) -> OrderedDict[bytes, TierEntry]:
        return self.store.entries

    @property
    def used_bytes(self) -> int:
        return self.store.used_bytes

    def __contains__(self, key: bytes) -> bool:
        return key in self.store

    def __len__(self) -> int:
        return len(self.store.entries)

    def put(self, e: TierEntry) -> list[TierEntry]:
        """Store e as the most recent entry; returns the unused entries aged out to make room."""
        if e.nbytes > self.capacity_bytes:
            raise ValueError(f"prefix record of {e.nbytes} bytes does not fit the transfer inbox ({self.capacity_bytes} bytes)")
        out = self.store.put(e)
        self.dropped += len(out)
        return out

    def deepest(self, salt: bytes, keys: Sequence[bytes], tokens: Sequence[int], page_size: int, limit: int) -> tuple[bytes, int] | None:
        """The deepest entry on `tokens` (keys: their page keys under `salt`). A record's boundary is not part of its key, so it
        is checked here against the tokens: one that disagrees (a buggy or forged exporter) is dropped, never unpacked."""
        found = self.store.index.deepest(salt, keys, tokens, page_size, limit)
        if found is None:
            return None
        key, p = found
        k = p // page_size
        if snapshot_key(keys[k - 1] if k else salt, tokens[k * page_size : p]) != key:
            self.discard(key, hit=False)
            self.dropped += 1
            return None
        return found

    def get(self, key: bytes) -> TierEntry | None:
        """The entry, left in place: the request may still fail to get cache this step and try again."""
        return self.entries.get(key)

    def discard(self, key: bytes, hit: bool) -> None:
        """The device holds `key`'s boundary now (`hit`: loaded from here; else the device had it already): let the copy go."""
        e = self.store.pop(key)
        if e is not None and hit:
            self.store.counters.hits += 1
            self.store.counters.bytes_out += e.nbytes

    def stats(self) -> TierStats:
        c = self.store.counters
        return TierStats(TierKind.INBOX, self.used_bytes, self.capacity_bytes, len(self.entries), c.bytes_in, c.bytes_out, c.hits, dropped=self.dropped)

    def check_integrity(self) -> None:
        used = sum(e.nbytes for e in self.entries.values())
        if used != self.used_bytes or used > self.capacity_bytes:
            raise AssertionError(f"TransferInbox: entries hold {used} B, counted {self.used_bytes} B, budget {self.capacity_bytes} B")
        indexed = {key for tails in self.store.index.by_anchor.values() for key, _ in tails.values()}
        if indexed != set(self.entries):
            raise AssertionError("TransferInbox: the anchor index and the entries differ")
