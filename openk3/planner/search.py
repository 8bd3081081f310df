"""Search layouts and batch sizes for the cheapest one that meets the SLOs, and say what binds each candidate.

Candidates: instance sizes (powers of two and whole system units), TP sizes inside the scale-up domain, balance
policies, redundant experts (none, or one per rank), and sequences per attention-DP group in powers of two up to what
HBM holds. A candidate is feasible when it fits, its per-user decode speed is at least `min_user_tok_s` and its TTFT at
most `max_ttft_s`. Feasible candidates are ranked by $ per 1M output tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from openk3.checks import fail
from openk3.config import ModelConfig
from openk3.planner.balance import BalanceParams
from openk3.planner.comm import CommParams
from openk3.planner.hardware import System
from openk3.planner.inputs import Balance, Layout, Quantisation, Workload
from openk3.planner.memory import DEFAULT_FILL, candidate_tps, max_concurrency
from openk3.planner.perf import Efficiency, Metrics, Scenario, evaluate


@dataclass(frozen=True)
class SLO:
    min_user_tok_s: float = 0.0
    max_ttft_s: float = float("inf")

    def __post_init__(self) -> None:
        if self.min_user_tok_s < 0:
            fail("SLO", "min_user_tok_s", self.min_user_tok_s, ">= 0")
        if not self.max_ttft_s > 0:
            fail("SLO", "max_ttft_s", self.max_ttft_s, "seconds > 0")


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    seqs_per_group: int
    metrics: Metrics
    meets_slo: bool
    miss: str  # why it misses the SLO ("" when it meets it)

    @property
    def concurrency(self) -> int:
        return self.seqs_per_group * self.layout.dp


@dataclass(frozen=True)
class SearchSpace:
    sizes: tuple[int, ...] | None = None  # None: derived from the system
    tps: tuple[int, ...] | None = None  # None: every divisor inside the scale-up domain up to 8
    balances: tuple[Balance, ...] = (Balance.EPLB, Balance.MOONEP)
    redundancy: bool = True
    max_seqs_per_group: int = 4096
    max_accelerators: int = 288


def default_sizes(system: System, max_accelerators: int) -> tuple[int, ...]:
    unit = system.accelerators_per_unit
    sizes = {2**i for i in range(0, 12)} | {unit * k for k in range(1, 9)}
    return tuple(sorted(s for s in sizes if s <= max_accelerators))


def _batches(limit: int, cap: int) -> list[int]:
    out = [b for b in (2**i for i in range(0, 13)) if b <= min(limit, cap)]
    if limit <= cap and limit not in out and limit > 0:
        out.append(limit)  # the memory-limited batch itself
    return out


@dataclass(frozen=True)
class SearchResult:
    candidates: tuple[Candidate, ...] = field(repr=False)

    @property
    def feasible(self) -> tuple[Candidate, ...]:
        return tuple(sorted((c for c in self.candidates if c.meets_slo), key=lambda c: c.metrics.usd_per_m_output))

    @property
    def best(self) -> Candidate | None:
        f = self.feasible
        return f[0] if f else None

    def best_per_size(self) -> dict[int, Candidate]:
        """Per instance size: the cheapest feasible candidate, else the fastest infeasible one (to show what binds)."""
        out: dict[int, Candidate] = {}
        for c in self.candidates:
            n = c.layout.num_accelerators
            cur = out.get(n)
            key = (c.meets_slo, -c.metrics.usd_per_m_output if c.meets_slo else c.metrics.per_user_tok_s)
            if cur is None or key > (cur.meets_slo, -cur.metrics.usd_per_m_output if cur.meets_slo else cur.metrics.per_user_tok_s):
                out[n] = c
        return dict(sorted(out.items()))


def _layouts(config: ModelConfig, system: System, space: SearchSpace) -> Iterable[Layout]:
    sizes = space.sizes or default_sizes(system, space.max_accelerators)
    for n in sizes:
        tps = [t for t in (space.tps or candidate_tps(n, system, max_tp=8)) if n % t == 0 and t <= system.scale_up_domain]
        for tp in tps:
            for balance in space.balances:
                redundant = (0, n) if space.redundancy and balance == Balance.EPLB and n > 1 else (0,)
                for r in redundant:
                    yield Layout(num_accelerators=n, tp=tp, redundant_experts=r, balance=balance)


def search(
    config: ModelConfig,
    quant: Quantisation,
    system: System,
    context: int,
    slo: SLO | None = None,
    prompt: int | None = None,
    space: SearchSpace | None = None,
    efficiency: Efficiency | None = None,
    comm: CommParams | None = None,
    balance: BalanceParams | None = None,
    fill: float = DEFAULT_FILL,
) -> SearchResult:
    slo, space = slo or SLO(), space or SearchSpace()
    efficiency, comm, balance = efficiency or Efficiency(), comm or CommParams(), balance or BalanceParams()
    out: list[Candidate] = []
    for layout in _layouts(config, system, space):
        limit_total = max_concurrency(config, quant, layout, context, system, fill)
        limit = limit_total // layout.dp
        if limit < 1:
            continue
        for b in _batches(limit, space.max_seqs_per_group):
            workload = Workload(context=context, concurrency=b * layout.dp, prompt=prompt)
            sc = Scenario(config, quant, layout, workload, system, efficiency, comm, balance, fill)
            m = evaluate(sc, memory_limited=2 * b > limit)
            miss = []
            if m.per_user_tok_s < slo.min_user_tok_s:
                miss.append(f"{m.per_user_tok_s:.1f} tok/s/user < {slo.min_user_tok_s:g}")
            if m.ttft_s > slo.max_ttft_s:
                miss.append(f"TTFT {m.ttft_s:.2f}s > {slo.max_ttft_s:g}s")
            out.append(Candidate(layout, b, m, not miss, "; ".join(miss)))
    return SearchResult(tuple(out))


def why_not(config: ModelConfig, quant: Quantisation, system: System, context: int, sizes: Sequence[int], fill: float = DEFAULT_FILL) -> dict[int, str]:
    """For instance sizes where nothing fits: how far the weights alone are over the fullest rank's HBM."""
    from openk3.planner.memory import working_set

    out: dict[int, str] = {}
    for n in sizes:
        best = None
        for tp in candidate_tps(n, system):
            ws = working_set(config, quant, Layout(n, tp=tp), Workload(context=context, concurrency=0), system, fill)
            if best is None or ws.total < best.total:
                best = ws
        if best is not None and not best.fits:
            out[n] = f"weights need {best.weights / 1e9:.0f} GB per accelerator > {best.capacity / 1e9:.0f} GB usable"
    return out
