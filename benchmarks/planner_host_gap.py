"""The host-gap grid of `openk3/planner/overheads.py`: median |error| of the tuned aggregated rows at each point.

    PYTHONPATH=. .venv/bin/python benchmarks/planner_host_gap.py

Prints one Markdown table (fixed part x per-sequence part -> median |error| of the 14 tuned TensorRT-LLM rows of
`validation_agg.py`, no held-out row), the best point with the fixed part at most 2 ms (the batch-1 bound the defaults
use) and the best without it,. Pure arithmetic: no device needed.
"""

from __future__ import annotations

import platform
import statistics
import subprocess
import sys

from openk3.planner.overheads import Overheads
from openk3.planner.perf import Efficiency
from openk3.planner.validation import CASES, Phase, Split
from openk3.planner.validation_agg import AGGREGATED_CASES, BLOG_CASES
from openk3.planner.validation_new import NEW_HELD_OUT_CASES

FIXED_MS = (0.0, 1.0, 2.0, 5.0, 7.5, 10.0, 15.0)
PER_SEQ_US = (0.0, 5.0, 10.0, 20.0, 40.0, 80.0)
BATCH1_BOUND_MS = 2.0  # published batch-1 decode steps are about this short (overheads.py)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    print(f"command: {' '.join([sys.executable.rsplit('/', 1)[-1], *sys.argv])}; machine: {platform.machine()} {platform.system()}; commit {_commit()}")
    tuned = [c for c in CASES + AGGREGATED_CASES + BLOG_CASES + NEW_HELD_OUT_CASES if c.split == Split.TUNED and c.phase == Phase.AGGREGATED]
    print(f"\ntuned aggregated rows: {len(tuned)}; cell: median |error| over them\n")
    print("| fixed \\ per sequence | " + " | ".join(f"{p:g} us" for p in PER_SEQ_US) + " |")
    print("|---|" + "---|" * len(PER_SEQ_US))
    grid: dict[tuple[float, float], float] = {}
    for f in FIXED_MS:
        for p in PER_SEQ_US:
            eff = Efficiency(overheads=Overheads(host_gap_s=f * 1e-3, host_gap_per_seq_s=p * 1e-6))
            grid[(f, p)] = statistics.median(abs(e) for c in tuned if (e := c.error(eff)) is not None)
        print(f"| {f:g} ms | " + " | ".join(f"{grid[(f, p)]:.1%}" for p in PER_SEQ_US) + " |")
    bounded = min((k for k in grid if k[0] <= BATCH1_BOUND_MS), key=grid.__getitem__)
    free = min(grid, key=grid.__getitem__)
    shipped = Overheads()
    print()
    print(f"best with the fixed part <= {BATCH1_BOUND_MS:g} ms: {bounded[0]:g} ms + {bounded[1]:g} us ({grid[bounded]:.1%})")
    print(f"best without the bound: {free[0]:g} ms + {free[1]:g} us ({grid[free]:.1%})")
    print(f"shipped default: {shipped.host_gap_s * 1e3:g} ms + {shipped.host_gap_per_seq_s * 1e6:g} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
