"""How far from the roofline the planner's kernels and scheduler run: flat factors or measured per-operator curves, plus
the scheduler overheads (issue 37 item 1)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from openk3.checks import fail
from openk3.planner.op_efficiency import OpCurves, curves_for
from openk3.planner.overheads import Overheads

KERNEL_MODES = ("measured", "flat")


@dataclass(frozen=True)
class Efficiency:
    """How far from the roofline the kernels and the scheduler run.

    `kernels="measured"` (default, `--kernels measured`): GEMM, grouped GEMM, MLA attention prefill/decode and TP
    all-reduce take the measured per-operator curves of the accelerator's family (`op_efficiency.py`), by shape; the
    flat factors then price only what has no curve (KDA, AttnRes, an accelerator without curves).
    `kernels="flat"` (`Efficiency.flat()`, `--kernels flat`): the first-order model, every component at the flat
    factors (HBM streaming 80%, GEMMs 50%, attention 30%: round numbers between two decode anchors). 70% of the expert
    communication hides under compute (two-batch overlap). `overheads` (CUDA-graph padding and the host gap per step)
    left None takes the kernel mode's own: the fitted ones (`Overheads()`) with measured kernels, none with flat
    factors, so `Efficiency(kernels="flat")` is the old model and `dataclasses.replace` of the mode keeps them paired.
    docs/planner.md compares both against the validation sets: the measured model is the closer on every one.
    `calibrate` fits the flat factors to a measurement."""

    hbm: float = 0.8
    gemm: float = 0.5
    attention: float = 0.3
    comm_overlap: float = 0.7
    kernels: str = "measured"
    overheads: Overheads | None = None

    def __post_init__(self) -> None:
        for name in ("hbm", "gemm", "attention"):
            if not 0 < getattr(self, name) <= 1:
                fail("Efficiency", name, getattr(self, name), "a fraction in (0, 1]")
        if not 0 <= self.comm_overlap <= 1:
            fail("Efficiency", "comm_overlap", self.comm_overlap, "a fraction in [0, 1]")
        if self.kernels not in KERNEL_MODES:
            fail("Efficiency", "kernels", self.kernels, f"one of {KERNEL_MODES}")

    @classmethod
    def ideal(cls) -> Efficiency:
        """Pure roofline: peaks reached, communication fully hidden, no scheduler overhead."""
        return cls(hbm=1.0, gemm=1.0, attention=1.0, comm_overlap=1.0, kernels="flat", overheads=Overheads.none())

    @classmethod
    def measured(cls) -> Efficiency:
        """The default: measured per-operator curves plus CUDA-graph padding and the fitted host gap (`overheads.py`)."""
        return cls(kernels="measured")

    @classmethod
    def flat(cls) -> Efficiency:
        """The first-order model (the default until issue 37 round five): flat factors, no scheduler overheads."""
        return cls(kernels="flat")

    @property
    def step_overheads(self) -> Overheads:
        """`overheads` as given, else the kernel mode's own: fitted with measured kernels, none with flat factors."""
        if self.overheads is not None:
            return self.overheads
        return Overheads() if self.kernels == "measured" else Overheads.none()

    def capturing(self, batch: int) -> Efficiency:
        """The engine a plan deploys for `batch` sequences per attention group: a CUDA graph captured at that batch
        (`Overheads.capturing`), the overheads otherwise the same."""
        return replace(self, overheads=self.step_overheads.capturing(batch))

    def curves(self, accelerator: str) -> OpCurves | None:
        return curves_for(accelerator) if self.kernels == "measured" else None
