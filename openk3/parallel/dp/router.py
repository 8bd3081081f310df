"""Which DP rank a new request goes to: prefix-affine, else least-loaded.

Legend: R ranks, U the prefix match unit (64 tokens, the prefix cache's hashing unit).

A prompt's first U tokens (the shortest prefix a cache can share) name a home rank: the rank that last received a
prompt starting with them, so conversations and shared system prompts keep hitting one rank's prefix cache. The home is
kept unless its load exceeds the least-loaded rank's by more than `max_imbalance_tokens`; then (and for prompts shorter
than U, or with no home yet) the least-loaded rank wins, ties to the lowest rank. Load = tokens a rank still has to
process or hold: prompt tokens plus max_tokens of its unfinished requests.
"""

from __future__ import annotations

from collections import OrderedDict


class DPRouter:
    def __init__(self, num_ranks: int, match_unit: int = 64, max_imbalance_tokens: int = 8192, max_prefixes: int = 65536) -> None:
        if num_ranks < 1:
            raise ValueError(f"DPRouter: num_ranks={num_ranks}, expected >= 1")
        self.num_ranks, self.match_unit, self.max_imbalance_tokens = num_ranks, match_unit, max_imbalance_tokens
        self.load = [0] * num_ranks
        self._homes: OrderedDict[tuple[int, ...], int] = OrderedDict()  # first U tokens -> rank, least recently used first
        self._max_prefixes = max_prefixes
        self._placed: dict[str, tuple[int, int]] = {}  # request id -> (rank, load it added)

    def place(self, request_id: str, prompt: list[int], max_tokens: int) -> int:
        if request_id in self._placed:
            raise ValueError(f"DPRouter: request id {request_id!r} is already placed")
        lightest = min(range(self.num_ranks), key=lambda r: (self.load[r], r))
        rank = lightest
        key = tuple(prompt[: self.match_unit]) if len(prompt) >= self.match_unit else None
        if key is not None:
            home = self._homes.get(key)
            if home is not None and self.load[home] - self.load[lightest] <= self.max_imbalance_tokens:
                rank = home
            self._homes[key] = rank
            self._homes.move_to_end(key)
            if len(self._homes) > self._max_prefixes:
                self._homes.popitem(last=False)
        cost = len(prompt) + max_tokens
        self.load[rank] += cost
        self._placed[request_id] = (rank, cost)
        return rank

    def rank_of(self, request_id: str) -> int | None:
        placed = self._placed.get(request_id)
        return None if placed is None else placed[0]

    def release(self, request_id: str) -> None:
        """The request ended (finished, aborted, or its admission failed): its load leaves its rank. Unknown ids: no-op."""
        placed = self._placed.pop(request_id, None)
        if placed is not None:
            self.load[placed[0]] -= placed[1]

    @property
    def num_placed(self) -> int:
        return len(self._placed)
