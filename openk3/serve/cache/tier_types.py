"""What every tier holds and reports: an entry (one prefix boundary's KDA snapshot + MLA latents in one buffer), its
stats, and the by-anchor index the host and disk tiers both use for lookups (tiers.py, disk_tier.py)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


class TierKind(str, enum.Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    INBOX = "inbox"  # prefixes imported from a prefill engine, waiting for their request (inbox.py)


@dataclass(frozen=True)
class TierEntry:
    key: bytes  # snapshot key (hashing.snapshot_key)
    anchor: bytes  # key of the last full page before the boundary (the salt when there is none)
    tail: tuple[int, ...]  # tokens after the anchor
    num_tokens: int  # the boundary p
    buffer: torch.Tensor  # transfer.pack layout, uint8 on the host

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


@dataclass(frozen=True)
class TierStats:
    tier: TierKind
    used_bytes: int
    capacity_bytes: int
    entries: int
    bytes_in: int  # stored into this tier
    bytes_out: int  # loaded from this tier back to the device
    hits: int
    checksum_failures: int = 0
    dropped: int = 0  # the inbox's records let go unused (aged out, or refused at lookup): hand-offs that were wasted
    write_failures: int = 0  # disk tier files that could not be written (a full or failing disk): those entries were let go


@dataclass
class Counters:
    bytes_in: int = 0
    bytes_out: int = 0
    hits: int = 0
    checksum_failures: int = 0
    write_failures: int = 0  # disk tier files that could not be written (the entry was let go)


@dataclass
class AnchorIndex:
    """Boundaries by anchor, so a lookup walks the request's page keys once instead of hashing every prefix length."""

    by_anchor: dict[bytes, dict[tuple[int, ...], tuple[bytes, int]]] = field(default_factory=dict)

    def add(self, e: TierEntry) -> None:
        self.by_anchor.setdefault(e.anchor, {})[e.tail] = (e.key, e.num_tokens)

    def remove(self, anchor: bytes, tail: tuple[int, ...]) -> None:
        tails = self.by_anchor.get(anchor)
        if tails is not None:
            tails.pop(tail, None)
            if not tails:
                del self.by_anchor[anchor]

    def deepest(self, salt: bytes, keys: Sequence[bytes], tokens: Sequence[int], page_size: int, limit: int) -> tuple[bytes, int] | None:
        best: tuple[bytes, int] | None = None
        for j, anchor in enumerate((salt, *keys)):
            for tail, (key, p) in self.by_anchor.get(anchor, {}).items():
                start = j * page_size
                if p <= limit and (best is None or p > best[1]) and tuple(tokens[start : start + len(tail)]) == tail:
                    best = (key, p)
        return best
