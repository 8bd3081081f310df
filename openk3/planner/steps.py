"""What one step of the busiest rank costs, by component: the types the step model (perf.py) returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Component:
    name: str
    bytes: float
    flops: float
    time_s: float
    bound: str  # "hbm" or "compute"


@dataclass(frozen=True)
class VerifyShape:
    """A speculative verify step per sequence: `queries` positions (k + 1), `state_passes` extra KDA state reads/writes
    (k per-position states written, plus 2 x P(reject) to copy the kept one), `recompute_tokens` KDA tokens rerun after a
    rejection (expected; 0 with per-position states)."""

    queries: int
    state_passes: float
    recompute_tokens: float


@dataclass(frozen=True)
class StepTime:
    components: tuple[Component, ...]
    comm_s: float  # all communication on the busiest rank before overlap
    exposed_comm_s: float
    imbalance: float
    tokens_per_group: float
    overhead_s: float = 0.0  # host gap the engine does not hide

    @property
    def local_s(self) -> float:
        return sum(c.time_s for c in self.components)

    @property
    def total_s(self) -> float:
        return self.local_s + self.exposed_comm_s + self.overhead_s

    @property
    def bytes(self) -> float:
        return sum(c.bytes for c in self.components)

    @property
    def flops(self) -> float:
        return sum(c.flops for c in self.components)

    @property
    def dominant(self) -> str:
        """The largest time term of the step, whatever limits the batch."""
        by = self.time_by_bound()
        return {"hbm": "HBM bandwidth", "compute": "compute", "interconnect": "interconnect"}[max(by, key=lambda k: by[k])]

    def time_by_bound(self) -> dict[str, float]:
        out = {"hbm": 0.0, "compute": 0.0, "interconnect": self.exposed_comm_s}
        for c in self.components:
            out[c.bound] += c.time_s
        return out
