"""BlockPool: fixed-size MLA pages handed out by id, with reference counts.

Contract: ids are 0..num_blocks-1; `allocate` takes from the front of the free queue and `free` returns blocks to its back in
the order given, so block ids are a deterministic function of the call sequence (tests assert exact ids). A block is either
free (ref count 0, in the queue exactly once) or held (ref count >= 1, not in the queue). Ref counts exist so that a prefix
shared by several requests (prefix cache, copy-on-write) is freed only when its last holder lets go.
Not thread-safe: the scheduler's thread owns it.
"""

from __future__ import annotations

from collections import deque

from openk3.checks import fail


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            fail("BlockPool", "num_blocks", num_blocks, ">= 0")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks if self.num_blocks else 0.0

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks with ref count 1, or None (and nothing taken) when fewer than n are free."""
        if n < 0:
            raise ValueError(f"BlockPool.allocate: n={n} is invalid: expected >= 0")
        if n > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Another holder takes the same blocks (prefix sharing); each must already be held."""
        for b in blocks:
            if self._ref[b] < 1:
                raise ValueError(f"BlockPool.share: block {b} is free; only held blocks can be shared")
            self._ref[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks whose count reaches 0 go back to the free queue in the given order."""
        for b in blocks:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"BlockPool.free: block {b} out of range 0..{self.num_blocks - 1}")
            if self._ref[b] < 1:
                raise ValueError(f"BlockPool.free: block {b} is already free (double free)")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)

    def check_integrity(self) -> None:
        free = list(self._free)
        if len(set(free)) != len(free):
            raise AssertionError(f"BlockPool: a block is in the free queue twice: {free}")
        free_set = set(free)
        for b in range(self.num_blocks):
            in_free, ref = b in free_set, self._ref[b]
            if in_free and ref != 0:
                raise AssertionError(f"BlockPool: block {b} is in the free queue with ref count {ref}")
            if not in_free and ref < 1:
                raise AssertionError(f"BlockPool: block {b} is neither free nor held (ref count {ref})")
