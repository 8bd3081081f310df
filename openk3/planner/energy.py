"""Energy of a step: wall power follows what the accelerator is doing, not its nameplate.

An accelerator's draw is split in two: the GPU's board power (`tdp_w`), which follows the step, and the rest of its wall
share (`power_w - tdp_w`: CPU, NIC, switches, fans, cooling), drawn whatever the load. Inside a step, time the busiest
rank spends compute-bound draws `compute` x TDP, HBM-bound time draws `hbm` x TDP, and the rest of the step (exposed
communication and the host gap: the rank waits on the fabric or the host) draws `idle` x TDP. Every other rank waits
for the busiest one, so one step's energy is the instance size times that of the busiest rank.

The fractions are estimates, not measurements: GPUs reach their power limit on dense GEMMs, memory-bound decode draws
well below it (prefill runs near TDP, decode far under: Splitwise, Patel et al. ISCA 2024), an idle H100/H200 draws
~10-20% of TDP. `PowerParams.nameplate()` charges full wall power all the time (what the spec's 1.1 tok/J assumes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from openk3.checks import fail


@dataclass(frozen=True)
class PowerParams:
    compute: float = 1.0  # [estimate] fraction of TDP while compute-bound
    hbm: float = 0.7  # [estimate] while HBM-bandwidth-bound
    idle: float = 0.2  # [estimate] while waiting on communication

    def __post_init__(self) -> None:
        for name in ("compute", "hbm", "idle"):
            if not 0 <= getattr(self, name) <= 1:
                fail("PowerParams", name, getattr(self, name), "a fraction of TDP in [0, 1]")

    @classmethod
    def nameplate(cls) -> PowerParams:
        """Full wall power whatever the load: an upper bound on energy."""
        return cls(compute=1.0, hbm=1.0, idle=1.0)


class _Step(Protocol):
    @property
    def total_s(self) -> float: ...

    def time_by_bound(self) -> dict[str, float]: ...


def step_power_w(step: _Step, tdp_w: float, wall_w: float, params: PowerParams) -> float:
    """Mean wall power of one accelerator over the step."""
    if step.total_s <= 0:
        return wall_w
    by = step.time_by_bound()
    waiting = step.total_s - by["compute"] - by["hbm"]  # exposed communication + host gap
    gpu_j = tdp_w * (params.compute * by["compute"] + params.hbm * by["hbm"] + params.idle * waiting)
    return max(wall_w - tdp_w, 0.0) + gpu_j / step.total_s
