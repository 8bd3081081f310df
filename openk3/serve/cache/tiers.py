"""Host-DRAM and disk tiers below the device pool: whole prefixes (KDA snapshot + MLA latents in one buffer) keyed like the
device index, each tier with a byte budget and LRU order.

Flow: the device index offloads a snapshot it evicts (`TierStack.offload`) into the host tier, or straight to disk when there is
no host budget; the host tier's LRU overflow goes to disk. Lookups (`find`) return the deepest boundary any tier holds; `load`
returns its buffer. The host tier keeps what it hands back (inclusive), so a prefix that bounces between device and host is
copied down once. Disk writes run on a background thread; an entry waiting to be written is served from memory. A disk load
re-hashes the payload and compares it with the checksum in the file header: a mismatch deletes the file and reports a miss, so
the request recomputes (never wrong text).
Threading: the engine thread calls everything; the writer thread touches only the disk tier (disk_tier.py), under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from openk3.serve.cache.disk_tier import DiskTier
from openk3.serve.cache.tier_types import AnchorIndex, Counters, TierEntry, TierKind, TierStats


class HostTier:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[bytes, TierEntry] = OrderedDict()
        self.index = AnchorIndex()
        self.used_bytes = 0
        self.counters = Counters()

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def put(self, e: TierEntry) -> list[TierEntry]:
        """Store e (most recent); returns what LRU pushed out to make room (e itself when it can never fit)."""
        if e.key in self.entries:
            self.entries.move_to_end(e.key)
            return []
        if e.nbytes > self.capacity_bytes:
            return [e]
        self.entries[e.key] = e
        self.index.add(e)
        self.used_bytes += e.nbytes
        self.counters.bytes_in += e.nbytes
        out = []
        while self.used_bytes > self.capacity_bytes:
            _, old = self.entries.popitem(last=False)
            self.index.remove(old.anchor, old.tail)
            self.used_bytes -= old.nbytes
            out.append(old)
        return out

    def pop(self, key: bytes) -> TierEntry | None:
        """Remove key's entry, if held, without counting a hit."""
        e = self.entries.pop(key, None)
        if e is not None:
            self.index.remove(e.anchor, e.tail)
            self.used_bytes -= e.nbytes
        return e

    def get(self, key: bytes) -> TierEntry:
        e = self.entries[key]
        self.entries.move_to_end(key)
        self.counters.hits += 1
        self.counters.bytes_out += e.nbytes
        return e

    def stats(self) -> TierStats:
        c = self.counters
        return TierStats(TierKind.HOST, self.used_bytes, self.capacity_bytes, len(self.entries), c.bytes_in, c.bytes_out, c.hits)


@dataclass
class TierMoves:
    """What an offload did beyond storing its entry, for the ranks that mirror this stack (prefix.py logs it for them):
    the entries the host tier's overflow sent to disk, in order, then the keys that left the stack altogether."""

    spilled: list[TierEntry] = field(default_factory=list)
    gone: list[bytes] = field(default_factory=list)


class TierStack:
    """Host then disk; either may be absent."""

    def __init__(self, host: HostTier | None, disk: DiskTier | None) -> None:
        self.host = host
        self.disk = disk

    def offload(self, e: TierEntry) -> TierMoves:
        """Store e (in the host tier, or straight to disk without one); returns what moved: the host tier's overflow goes
        to disk, and what neither keeps (the overflow without a disk tier, the disk budget's LRU files) is gone."""
        overflow = self.host.put(e) if self.host is not None else [e]
        if self.disk is None:
            return TierMoves(gone=[old.key for old in overflow])
        moves = TierMoves()
        for old in overflow:
            moves.spilled.append(old)
            moves.gone.extend(self.disk.put(old))
        return moves

    def contains(self, key: bytes) -> bool:
        return (self.host is not None and key in self.host) or (self.disk is not None and key in self.disk)

    def deepest(self, salt: bytes, keys: Sequence[bytes], tokens: Sequence[int], page_size: int, limit: int) -> tuple[TierKind, bytes, int] | None:
        best: tuple[TierKind, bytes, int] | None = None
        if self.host is not None:
            found = self.host.index.deepest(salt, keys, tokens, page_size, limit)
            if found is not None:
                best = (TierKind.HOST, *found)
        if self.disk is not None:
            found = self.disk.deepest(salt, keys, tokens, page_size, limit)
            if found is not None and (best is None or found[1] > best[2]):
                best = (TierKind.DISK, *found)
        return best

    def load(self, tier: TierKind, key: bytes) -> torch.Tensor | None:
        if tier == TierKind.HOST and self.host is not None and key in self.host:
            return self.host.get(key).buffer
        if tier == TierKind.DISK and self.disk is not None:
            return self.disk.load(key)
        return None

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> tuple[TierStats, ...]:
        return tuple(t.stats() for t in (self.host, self.disk) if t is not None)
