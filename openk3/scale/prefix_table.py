"""The routing rule: send a request to the replica holding the longest cached prefix of it, else to the least loaded.

A replica's cache is modelled by the chained match-unit keys of the requests it was sent (openk3/serve/cache/hashing.py):
key j of a request stands for its first (j + 1) x unit tokens, so a replica "holds" a prefix of depth d when it has seen
the request's key d - 1. The table is the router's belief, not the replica's truth: it forgets the oldest keys past a
bound (an engine evicts too), and it forgets a replica that died (its restart comes back empty).

Only the private part of a match draws a request (issue 36: with one shared system prompt every conversation matched the
replica that had seen it first, and 18 of 18 turns went there while the other replica idled). The table remembers, for
each key, whether requests have continued it in different ways: such a key is a branch point of the prefix tree (the end
of a system prompt that many conversations share), which every replica soon holds whatever the routing, since any request
that lands there caches it. The request's shared depth is the depth of its deepest branch point; what a replica holds
beyond it -- the conversation's own history -- is its private match. Requests go to the deepest private match; ties
(among them every new conversation, whose private match is 0 everywhere) go to the replica that has been sent the fewest
requests since it joined, so that conversations, not only the requests in flight, are spread (SGLang's cache-aware
router sends a low match to the smallest tree instead, but tree size tracks how far a replica's conversations have got
rather than how many it holds: in one of three runs of benchmarks/scale_routing.py it left 20 of 32 requests on one
replica), then to the one with the fewest requests in flight, the deeper whole match, the lowest id (a decision is
reproducible). A replica `max_imbalance` or more requests busier than the least loaded one goes after all others, its
match notwithstanding.
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
    private_units: int = 0  # of those, the units past the request's deepest branch point (what draws it there)


# A key's recorded continuation when requests have continued it in more than one way (a branch point).
_BRANCHES = b""


class PrefixTable:
    """Replica id -> the match-unit keys it was sent (LRU), and its requests in flight. Not thread-safe: one router owns it."""

    def __init__(self, config: TableConfig | None = None) -> None:
        self.config = config or TableConfig()
        self._keys: dict[str, OrderedDict[bytes, None]] = {}
        self._in_flight: dict[str, set[str]] = {}
        self._sent: dict[str, int] = {}  # requests routed to each replica since it joined
        self._where: OrderedDict[str, str] = OrderedDict()  # request not yet completed -> the replica it counts as sent to
        # key -> the next key of the requests routed through it, or _BRANCHES once two differed; LRU, bounded like the replicas'
        self._next: OrderedDict[bytes, bytes] = OrderedDict()

    @property
    def replicas(self) -> tuple[str, ...]:
        return tuple(sorted(self._keys))

    def add_replica(self, replica: str) -> None:
        self._keys.setdefault(replica, OrderedDict())
        self._in_flight.setdefault(replica, set())
        self._sent.setdefault(replica, 0)

    def forget(self, replica: str) -> None:
        """A replica that died: its cache died with it, and its requests in flight failed."""
        self._keys.pop(replica, None)
        self._in_flight.pop(replica, None)
        self._sent.pop(replica, None)
        self._where = OrderedDict((r, at) for r, at in self._where.items() if at != replica)

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

    def shared_depth(self, keys: Sequence[bytes]) -> int:
        """Units of `keys` up to and including its deepest branch point: a key that routed requests (this one counted)
        continued in different ways."""
        for j in range(len(keys) - 1, -1, -1):
            known = self._next.get(keys[j])
            if known is not None and (known == _BRANCHES or (j + 1 < len(keys) and known != keys[j + 1])):
                return j + 1
        return 0

    def rank(self, keys: Sequence[bytes], candidates: Iterable[str], avoid: Iterable[str] = ()) -> list[Choice]:
        """`candidates` best first. Replicas in `avoid` (one that just failed this request) go last."""
        avoided = set(avoid)
        shared = self.shared_depth(keys)
        scored = [Choice(r, d, max(0, d - shared)) for r in candidates for d in (self.depth(r, keys),)]
        if not scored:
            return []
        least = min(self.load(c.replica) for c in scored)

        def order(c: Choice) -> tuple[bool, bool, int, int, int, int, str]:
            load = self.load(c.replica)
            overloaded = load - least >= self.config.max_imbalance
            return (c.replica in avoided, overloaded, -c.private_units, self._sent.get(c.replica, 0), load, -c.matched_units, c.replica)

        return sorted(scored, key=order)

    def chosen(self, replica: str, request_id: str) -> None:
        """The router's first choice for a request, before Ray confirms where it went (`routed`): it counts as sent there
        at once. Ray routes a burst of requests before it reports any of them routed; without this, every new conversation
        of the burst would see the same counts and make the same choice. (Not in flight yet: a choice Ray never carries
        out must not hold a replica's load up for good.)"""
        self._count_sent(replica, request_id)

    def routed(self, replica: str, request_id: str, keys: Sequence[bytes]) -> None:
        """The request went to `replica`: from now on it caches the request's prefix (the engine snapshots prompt ends)."""
        self._count_sent(replica, request_id)
        self._in_flight[replica].add(request_id)
        held = self._keys[replica]
        for key in keys:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.config.max_keys_per_replica:
            held.popitem(last=False)
        for key, following in zip(keys, keys[1:], strict=False):
            known = self._next.get(key)
            self._next[key] = following if known in (None, following) else _BRANCHES
            self._next.move_to_end(key)
        while len(self._next) > self.config.max_keys_per_replica * max(1, len(self._keys)):
            self._next.popitem(last=False)

    def _count_sent(self, replica: str, request_id: str) -> None:
        """Count the request as sent to `replica` once, moving the count there if it was counted elsewhere."""
        self.add_replica(replica)
        before = self._where.get(request_id)
        if before == replica:
            return
        if before is not None and before in self._sent:
            self._sent[before] -= 1
        self._where[request_id] = replica
        self._where.move_to_end(request_id)
        while len(self._where) > self.config.max_keys_per_replica:  # choices Ray never carried out are never completed
            self._where.popitem(last=False)
        self._sent[replica] += 1

    def completed(self, replica: str, request_id: str) -> None:
        self._in_flight.get(replica, set()).discard(request_id)
        self._where.pop(request_id, None)
