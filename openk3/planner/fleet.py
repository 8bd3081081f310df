"""The fleet for a rate: replicas of one layout, plus at most one replica of another for what is left (issue 37 item 1).

A plan with a rate provisions ceil(rate / per-replica rate) replicas of its headline layout (`plan.request_rank`), so a
replica that lands just under the rate doubles the fleet: 10 requests/s on a replica that serves 9.99 takes two
replicas half used. Two facts size a fleet better:

- how fast one replica may serve and keep its users at the SLO. With a workload a replica's decode steps wait while it
  prefills arriving requests (`workload.decode_stretch`): serving `s` requests/s, each user sees the decode step's speed
  u times (1 - s x prefill busy seconds per request). The per-user SLO m therefore caps the rate one replica serves
  within it at (1 - m / u) / prefill busy, below its capacity 1 / busy when the SLO binds first (`slo_rate`); a replica
  that misses the TTFT SLO, or whose decode steps alone are slower than m, serves none;
- a router may split a rate unevenly (weighted round robin): k replicas of the layout each at that cap and one replica
  of a cheaper layout (fewer accelerators) for the remainder cost fewer accelerators than k + 1 of the first whenever
  some layout of fewer accelerators serves the remainder within the SLO.

`best_fleet` searches both shapes over every candidate the search priced (a candidate that misses the SLO at its own
capacity can still meet it at a lower served rate) and keeps the one with the fewest accelerators, a single layout on a
tie. The headline's tables stay those of its one layout; the report adds the fleet when it is cheaper and always says
the rate a headline replica serves within the SLO, where the fleet steps by a replica.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from openk3.planner.search import SLO, Candidate

RATE_TOLERANCE = 1e-9  # requests/s: a replica serving the rate to within this serves it


def slo_rate(c: Candidate, slo: SLO) -> float:
    """The most requests/s one replica of `c` serves with its users at the SLO: its capacity, or less where the per-user
    SLO binds first (prefill interleaved at the served rate slows its decode steps); 0 when no rate meets the SLO."""
    if c.busy_s is None or c.prefill_busy_s is None:
        raise ValueError(f"slo_rate needs a candidate searched with a workload ({c.describe()} has no busy seconds per request)")
    capacity = 1 / c.busy_s
    u, m = c.metrics.per_user_tok_s, slo.min_user_tok_s
    if c.metrics.ttft_s > slo.max_ttft_s or u < m:
        return 0.0
    if m <= 0 or c.prefill_busy_s <= 0:
        return capacity
    return min(capacity, (1 - m / u) / c.prefill_busy_s)


@dataclass(frozen=True)
class FleetPart:
    candidate: Candidate
    replicas: int
    served_rps: float  # per replica
    slo_rps: float  # the most one replica serves within the SLO (`slo_rate`)

    @property
    def accelerators(self) -> int:
        return self.replicas * self.candidate.layout.num_accelerators

    def user_tok_s(self) -> float:
        """What each user of these replicas sees at their served rate (the per-user SLO is checked on this)."""
        pb = self.candidate.prefill_busy_s or 0.0
        return self.candidate.metrics.per_user_tok_s * (1 - self.served_rps * pb)


@dataclass(frozen=True)
class Fleet:
    rate: float
    parts: tuple[FleetPart, ...]  # the main layout first; a second part is the remainder replica

    @property
    def accelerators(self) -> int:
        return sum(p.accelerators for p in self.parts)

    @property
    def mixed(self) -> bool:
        return len(self.parts) > 1

    def usd_per_request(self, price_per_hour: float) -> float:
        """$ per request at the provisioned fleet: its accelerator-hours over the requests it serves."""
        return price_per_hour * self.accelerators / 3600 / self.rate

    def describe(self) -> str:
        return " + ".join(
            f"{p.replicas} x {p.candidate.describe()} ({p.candidate.seqs_per_group} seq/group) at {p.served_rps:.3g} requests/s" for p in self.parts
        )


def homogeneous(c: Candidate, slo: SLO, rate: float) -> Fleet | None:
    """Replicas of `c` alone, the rate spread evenly over as few as serve it within the SLO; None if one serves none."""
    cap = slo_rate(c, slo)
    if cap <= 0:
        return None
    n = max(1, math.ceil(rate / cap - RATE_TOLERANCE))
    return Fleet(rate, (FleetPart(c, n, rate / n, cap),))


def best_fleet(candidates: Sequence[Candidate], slo: SLO, rate: float) -> Fleet | None:
    """The fleet of fewest accelerators for `rate` requests/s: replicas of one candidate, or k of one at its SLO rate and
    one replica of another (of fewer accelerators) for the remainder. Ties: one layout first, then the fewer
    accelerator-seconds per request at full use of the main layout. None when no candidate serves any rate within the
    SLO."""
    if not rate > 0:
        raise ValueError(f"best_fleet needs a rate > 0 requests/s; got {rate}")
    caps = [(c, slo_rate(c, slo)) for c in candidates]
    caps = [(c, r) for c, r in caps if r > 0]
    by_size = sorted(caps, key=lambda cr: (cr[0].layout.num_accelerators, cr[0].layout.num_accelerators * (cr[0].busy_s or 0.0)))
    best: Fleet | None = None

    def key(f: Fleet) -> tuple[float, int, float]:
        main = f.parts[0].candidate
        return (float(f.accelerators), len(f.parts), main.layout.num_accelerators * (main.busy_s or 0.0))

    for c, cap in caps:
        options = [homogeneous(c, slo, rate)]
        k = math.floor(rate / cap + RATE_TOLERANCE)
        rest = rate - k * cap
        if k >= 1 and rest > RATE_TOLERANCE:
            small = next(((s, r) for s, r in by_size if r >= rest and s.layout.num_accelerators < c.layout.num_accelerators), None)
            if small is not None:
                options.append(Fleet(rate, (FleetPart(c, k, cap, cap), FleetPart(small[0], 1, rest, small[1]))))
        for f in options:
            if f is not None and (best is None or key(f) < key(best)):
                best = f
    return best


def describe(fleet: Fleet | None, headline: Candidate, headline_rps: float, provisioned: int, price_per_hour: float, price_note: str = "") -> list[str]:
    """The report's lines: where the headline's fleet steps by a replica, and the fleet of fewer accelerators if any."""
    rate = fleet.rate if fleet is not None else None
    lines = []
    if headline_rps > 0:
        why = "its capacity binds" if headline_rps >= 1 / (headline.busy_s or math.inf) - RATE_TOLERANCE else "the per-user SLO binds before its capacity"
        step = f"  fleet step: one replica of this layout serves at most {headline_rps:.3f} requests/s within the SLO ({why})"
        if rate is not None:
            n = max(1, math.ceil(rate / headline_rps - RATE_TOLERANCE))
            last = (rate - (n - 1) * headline_rps) / headline_rps
            full = f"fill {n - 1} and load the last" if n > 1 else "load one"
            step += f"; {rate:g} requests/s {full} to {last:.0%} of that"
        lines.append(step)
    if fleet is not None and fleet.accelerators < provisioned:
        users = " / ".join(f"{p.user_tok_s():.1f}" for p in fleet.parts)
        lines.append(
            f"  fewer accelerators{' with a remainder replica' if fleet.mixed else ''}: {fleet.describe()} = {fleet.accelerators:,} "
            f"accelerators against {provisioned:,} (users see {users} tok/s); ${fleet.usd_per_request(price_per_hour):.5f} per request at "
            f"that fleet{price_note}"
        )
    return lines
