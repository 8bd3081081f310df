"""Which other replica holds a deeper prefix of a request than the one it is routed to: the router's half of the
cross-replica prefix pull (the replica's half is scale/prefix_pull.py, the engine's serve/prefix_pull.py).

The router sends a request where load and its private match say (prefix_table.py); that replica may lack a prefix another
replica holds -- the shared system prompt on a replica's first conversation, a conversation moved for load. The hint
table remembers, per match-unit key, the replicas requests carrying it were sent to (at once when the router chooses: a
burst of new conversations is routed before Ray reports any of them routed, and the second replica's first request is
the one that can pull from the first's). For a request about to land on replica B, the hint names the replica that most
recently took the deepest key of the request that B was never sent, when that key is at least `min_units` deeper than
B's deepest: B then asks that replica for the prefix before its engine sees the request. It is a belief, like the
prefix table: the holder may have evicted the prefix, or be computing it still (it answers after its step), or B may
hold it through a request the table forgot; B checks its own cache first and a wrong hint costs one refused call.
Bounded (LRU over keys); a replica that died is forgotten. Not thread-safe: one router owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from openk3.checks import check_int
from openk3.scale.calls import PullHint

HOLDERS_PER_KEY = 4  # the most recent replicas per key: enough to find one alive that is not the landing replica


class PullHints:
    def __init__(self, min_units: int = 1, max_keys: int = 1 << 16) -> None:
        check_int("PullHints", "min_units", min_units, low=1)
        check_int("PullHints", "max_keys", max_keys, low=1)
        self.min_units = min_units
        self.max_keys = max_keys
        self._holders: OrderedDict[bytes, tuple[str, ...]] = OrderedDict()  # key -> replicas sent it, most recent last

    def __len__(self) -> int:
        return len(self._holders)

    def sent(self, replica: str, keys: Sequence[bytes]) -> None:
        """A request carrying `keys` was sent (or chosen to be sent) to `replica`: it will hold their prefixes."""
        for key in keys:
            held = tuple(r for r in self._holders.get(key, ()) if r != replica)
            self._holders[key] = (*held, replica)[-HOLDERS_PER_KEY:]
            self._holders.move_to_end(key)
        while len(self._holders) > self.max_keys:
            self._holders.popitem(last=False)

    def hint(self, keys: Sequence[bytes], landing: str, alive: Iterable[str]) -> PullHint | None:
        """The replica to pull from, and the units it holds, for a request routed to `landing`; None when no live replica
        is believed to hold at least `min_units` more of it than `landing` does."""
        live = set(alive)
        own = next((j + 1 for j in range(len(keys) - 1, -1, -1) if landing in self._holders.get(keys[j], ())), 0)
        for j in range(len(keys) - 1, -1, -1):
            if j + 1 - own < self.min_units:
                return None
            others = [r for r in self._holders.get(keys[j], ()) if r != landing and r in live]
            if others:
                return PullHint(others[-1], j + 1)
        return None

    def forget(self, replica: str) -> None:
        """A replica that died (its restart is empty) or left the set."""
        for key in [k for k, held in self._holders.items() if replica in held]:
            held = tuple(r for r in self._holders[key] if r != replica)
            if held:
                self._holders[key] = held
            else:
                del self._holders[key]

    def retain(self, replicas: Iterable[str]) -> None:
        """The replica set is now `replicas`: every other replica is forgotten."""
        keep = set(replicas)
        for gone in {r for held in self._holders.values() for r in held} - keep:
            self.forget(gone)
