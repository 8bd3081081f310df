"""The routing rule: send a request to the replica holding the longest cached prefix of it, else to the least loaded.

A replica's cache is modelled by the chained match-unit keys of the requests it was sent (openk3/serve/cache/hashing.py):
key j of a request stands for its first (j + 1) x unit tokens, so a replica "holds" a prefix of depth d when it has seen
the request's key d - 1. The table is the router's belief, not the replica's truth: it forgets the oldest keys past a
bound (an engine evicts too), and it forgets a replica that died (its restart comes back empty).

Ties on depth, and requests matching nowhere, go to the replica with the fewest requests in flight (then the lowest id, so
a decision is reproducible). A match loses to load when the matching replica has `max_imbalance` more requests in flight
than the least loaded one: a shared system prompt must not pin every conversation to one replica.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from openk3.checks import check_int


@dataclass(frozen=True)
class TableConfig:
    max_keys_per_replica: int = 1 << 16  # 64-token units: 4M tokens of belief per replica
    max_imbalance: int = 4  # in-flight requests a prefix match may cost over the least loaded replica

    def __post_init__(self) -> None:
        check_int("TableConfig", "max_keys_per_replica", self.max_keys_per_replica, low=1)
        check_int("TableConfig", "max_imbalance", self.max_imbalance, low=1)


@dataclass(frozen=True)
class Choice:
    replica: str
    matched_units: int  # depth of the prefix the chosen replica is believed to hold


class PrefixTable:
    """Replica id -> the match-unit keys it was sent (LRU), and its requests in flight. Not thread-safe: one router owns it."""

    def __init__(self, config: TableConfig | None = None) -> None:
        self.config = config or TableConfig()
        self._keys: dict[str, OrderedDict[bytes, None]] = {}
        self._in_flight: dict[str, set[str]] = {}

    @property
    def replicas(self) -> tuple[str, ...]:
        return tuple(sorted(self._keys))

    def add_replica(self, replica: str) -> None:
        self._keys.setdefault(replica, OrderedDict())
        self._in_flight.setdefault(replica, set())

    def forget(self, replica: str) -> None:
        """A replica that died: its cache died with it, and its requests in flight failed."""
        self._keys.pop(replica, None)
        self._in_flight.pop(replica, None)

    def retain(self, replicas: Iterable[str]) -> None:
        """The replica set is now `replicas`: new ones start empty, missing ones are forgotten."""
        keep = set(replicas)
        for gone in set(self._keys) - keep:
            self.forget(gone)
        for replica in keep:
            self.add_replica(replica)

    def load(self, replica: str) -> int:
        return len(self._in_flight.get(replica, ()))

    def depth(self, replica: str, keys: Sequence[bytes]) -> int:
        held = self._keys.get(replica)
        if not held:
            return 0
        # chained keys: holding key j implies the whole prefix up to it, so the deepest held key is the match
        for j in range(len(keys) - 1, -1, -1):
            if keys[j] in held:
                return j + 1
        return 0

    def rank(self, keys: Sequence[bytes], candidates: Iterable[str], avoid: Iterable[str] = ()) -> list[Choice]:
        """`candidates` best first. Replicas in `avoid` (one that just failed this request) go last."""
        avoided = set(avoid)
        scored = [Choice(r, self.depth(r, keys)) for r in candidates]
        if not scored:
            return []
        least = min(self.load(c.replica) for c in scored)

        def order(c: Choice) -> tuple[bool, int, int, str]:
            depth = c.matched_units if self.load(c.replica) - least < self.config.max_imbalance else 0
            return (c.replica in avoided, -depth, self.load(c.replica), c.replica)

        return sorted(scored, key=order)

    def routed(self, replica: str, request_id: str, keys: Sequence[bytes]) -> None:
        """The request went to `replica`: from now on it caches the request's prefix (the engine snapshots prompt ends)."""
        self.add_replica(replica)
        held = self._keys[replica]
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.config.max_keys_per_replica:
            held.popitem(last=False)
        self._in_flight[replica].add(request_id)

    def completed(self, replica: str, request_id: str) -> None:
        self._in_flight.get(replica, set()).discard(request_id)
