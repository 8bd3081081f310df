"""The SLO-constrained Pareto front of a search: tokens/s per accelerator against tokens/s per user.

Every evaluated (layout, batch) point becomes a row with its figures and feasibility; a feasible point is on the front
when no other feasible point is at least as good on both axes and better on one. The front is what a deployment
trades along: more sequences per group raise throughput per accelerator and lower each user's speed, and the SLO cuts
the curve where users become too slow (or TTFT too long). Infeasible points stay in the rows (flagged), so a plot can
show where the SLO cuts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from openk3.planner.search import Candidate


@dataclass(frozen=True)
class FrontRow:
    candidate: Candidate
    feasible: bool
    pareto: bool

    @property
    def per_user_tok_s(self) -> float:
        """What a user sees (prefill interleaved when a workload implies it)."""
        return self.candidate.user_tok_s

    @property
    def per_accelerator_tok_s(self) -> float:
        return self.candidate.metrics.per_accelerator_tok_s


def pareto_rows(candidates: Sequence[Candidate]) -> tuple[FrontRow, ...]:
    """Rows for every candidate; `pareto` marks the feasible ones no other feasible candidate dominates. Ties (the same
    point reached by two layouts) keep the cheaper one on the front."""
    feasible = [c for c in candidates if c.meets_slo]
    # sweep: sort by per-user speed descending, then throughput descending, cost ascending; a point is on the front when its
    # throughput beats every faster point's
    order = sorted(feasible, key=lambda c: (-c.user_tok_s, -c.metrics.per_accelerator_tok_s, c.metrics.usd_per_m_output))
    front: set[int] = set()
    best = float("-inf")
    for c in order:
        if c.metrics.per_accelerator_tok_s > best:
            front.add(id(c))
            best = c.metrics.per_accelerator_tok_s
    return tuple(FrontRow(c, c.meets_slo, id(c) in front) for c in candidates)


def front(rows: Sequence[FrontRow]) -> list[FrontRow]:
    """The front alone, fastest per user first."""
    return sorted((r for r in rows if r.pareto), key=lambda r: -r.per_user_tok_s)
