"""A small Python-native RL environment for process snapshots: a random walk with a score and optional memory ballast.

`ballast_mb` allocates and touches that much memory so benchmarks can measure snapshot cost against a realistic heap.
"""

from __future__ import annotations

import random
from typing import Any


class RandomWalkEnv:
    def __init__(self, ballast_mb: int = 0, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.position = 0
        self.steps = 0
        self.history: list[int] = []
        self.ballast = bytearray(ballast_mb * 2**20)
        for i in range(0, len(self.ballast), 4096):
            self.ballast[i] = 1  # touch every page so the heap is resident, as a real environment's would be

    def reseed(self, seed: int) -> None:
        self.rng.seed(seed)

    def step(self, action: int) -> dict[str, Any]:
        noise = self.rng.choice((-1, 0, 1))
        self.position += int(action) + noise
        self.steps += 1
        self.history.append(self.position)
        return {"position": self.position, "steps": self.steps, "noise": noise}

    def state(self) -> dict[str, Any]:
        return {"position": self.position, "steps": self.steps, "history": list(self.history)}

    def set_position(self, position: int) -> int:
        self.position = int(position)
        return self.position

    def sample(self) -> float:
        return self.rng.random()
