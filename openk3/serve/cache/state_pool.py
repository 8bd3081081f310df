"""StatePool: KDA state slots (recurrent state + conv window per KDA layer), one per running sequence.

Contract: slot ids are 0..num_slots-1, handed out from the front of the free queue and returned to its back, so ids are
deterministic. A slot holds one sequence's state, updated in place by the model; it cannot be shared (the state of a
prefix is preserved by copying it into another slot, a snapshot, never by aliasing). The pool never zeroes a slot: the
model starts any sequence with context length 0 from a zero state whatever the slot holds.
"""

from __future__ import annotations

from collections import deque

from openk3.checks import fail


class StatePool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            fail("StatePool", "num_slots", num_slots, ">= 1")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._held = [False] * num_slots

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def is_held(self, slot: int) -> bool:
        return self._held[slot]

    def allocate(self) -> int | None:
        """A free slot, or None when every slot is held."""
        if not self._free:
            return None
        slot = self._free.popleft()
        self._held[slot] = True
        return slot

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"StatePool.free: slot {slot} out of range 0..{self.num_slots - 1}")
        if not self._held[slot]:
            raise ValueError(f"StatePool.free: slot {slot} is already free (double free)")
        self._held[slot] = False
        self._free.append(slot)

    def check_integrity(self) -> None:
        free = list(self._free)
        if len(set(free)) != len(free):
            raise AssertionError(f"StatePool: a slot is in the free queue twice: {free}")
        free_set = set(free)
        for s in range(self.num_slots):
            if (s in free_set) == self._held[s]:
                raise AssertionError(f"StatePool: slot {s} is held={self._held[s]} but in_free_queue={s in free_set}")
