"""How far from the roofline the planner's kernels and scheduler run: flat factors or measured per-operator curves, plus
the scheduler overheads (issue 37 item 1)."""

from __future__ import annotations

from dataclasses import dataclass, field

from openk3.checks import fail
from openk3.planner.op_efficiency import OpCurves, curves_for
from openk3.planner.overheads import Overheads

KERNEL_MODES = ("measured", "flat")


@dataclass(frozen=True)
class Efficiency:
    """How far from the roofline the kernels and the scheduler run.

    `kernels="flat"` (default): every component takes the flat factors (HBM streaming 80%, GEMMs 50%, attention 30%:
    round numbers between two decode anchors). `kernels="measured"` (`Efficiency.measured()`, `--kernels measured`):
    GEMM, grouped GEMM, MLA attention prefill/decode and TP all-reduce take the measured per-operator curves of the
    accelerator's family (`op_efficiency.py`), by shape; the flat factors then price only what has no curve (KDA,
    AttnRes, GQA attention, an accelerator without curves). 70% of the expert communication hides under compute
    (two-batch overlap); `overheads` adds CUDA-graph padding and the host gap per step (none by default, the measured
    model's fitted ones with `measured()`). docs/planner.md compares both against the validation set: neither is the
    better one everywhere, which is why the default stays. `calibrate` fits the flat factors to a measurement."""

    hbm: float = 0.8
    gemm: float = 0.5
    attention: float = 0.3
    comm_overlap: float = 0.7
    kernels: str = "flat"
    overheads: Overheads = field(default_factory=Overheads.none)

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
        """Measured per-operator curves plus CUDA-graph padding and the fitted host gap (`overheads.py`)."""
        return cls(kernels="measured", overheads=Overheads())

    def curves(self, accelerator: str) -> OpCurves | None:
        return curves_for(accelerator) if self.kernels == "measured" else None
