"""Fit the efficiency factors to measured step times.

A measurement is a scenario (model, layout, workload, hardware) and the decode (or prefill) step time someone
observed. The fit minimises the squared log error of predicted vs measured step time over the chosen factors by
coordinate descent with a golden-section search per factor: derivative-free, deterministic, no dependency. With one
measurement fit one factor (the one that binds there); with several, fit several.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from openk3.checks import fail
from openk3.planner.perf import Efficiency, Scenario, decode_step, prefill_step

FACTORS = ("hbm", "gemm", "attention", "comm_overlap")
_BOUNDS = {"hbm": (0.05, 1.0), "gemm": (0.02, 1.0), "attention": (0.02, 1.0), "comm_overlap": (0.0, 1.0)}
_GOLDEN = (math.sqrt(5) - 1) / 2


@dataclass(frozen=True)
class Measurement:
    scenario: Scenario
    step_s: float
    phase: str = "decode"  # or "prefill": one prefill chunk

    def __post_init__(self) -> None:
        if not self.step_s > 0:
            fail("Measurement", "step_s", self.step_s, "seconds > 0")
        if self.phase not in ("decode", "prefill"):
            fail("Measurement", "phase", self.phase, "'decode' or 'prefill'")


def predict(m: Measurement, eff: Efficiency) -> float:
    sc = m.scenario.with_(efficiency=eff)
    return (decode_step(sc) if m.phase == "decode" else prefill_step(sc)).total_s


def loss(measurements: Sequence[Measurement], eff: Efficiency) -> float:
    return sum(math.log(predict(m, eff) / m.step_s) ** 2 for m in measurements)


def _golden(f, lo: float, hi: float, iters: int = 40) -> float:
    a, b = lo, hi
    c, d = b - _GOLDEN * (b - a), a + _GOLDEN * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - _GOLDEN * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + _GOLDEN * (b - a)
            fd = f(d)
    return (a + b) / 2


@dataclass(frozen=True)
class Fit:
    efficiency: Efficiency
    loss: float
    errors: tuple[float, ...]  # predicted / measured - 1, per measurement


def calibrate(measurements: Sequence[Measurement], factors: Sequence[str] = ("gemm",), start: Efficiency | None = None, rounds: int = 6) -> Fit:
    """Efficiency factors (only those named) that best reproduce the measured step times; the others stay at `start`."""
    if not measurements:
        raise ValueError("calibrate: expected at least one measurement")
    bad = [f for f in factors if f not in FACTORS]
    if bad:
        raise ValueError(f"calibrate: factors {bad} are invalid: expected names from {FACTORS}")
    eff = start or measurements[0].scenario.efficiency
    for _ in range(rounds):
        for name in factors:
            lo, hi = _BOUNDS[name]
            best = _golden(lambda x, n=name, e=eff: loss(measurements, replace(e, **{n: x})), lo, hi)  # type: ignore[arg-type]
            eff = replace(eff, **{name: best})  # type: ignore[arg-type]
    errors = tuple(predict(m, eff) / m.step_s - 1 for m in measurements)
    return Fit(efficiency=eff, loss=loss(measurements, eff), errors=errors)
