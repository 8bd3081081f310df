"""Search layouts and batch sizes for the cheapest one that meets the SLOs, and say what binds each candidate.

Candidates: instance sizes (powers of two and whole system units), TP sizes inside the scale-up domain that divide the
attention heads, balance policies, redundant experts (none, or one per rank), and sequences per attention-DP group: powers
of two up to what HBM holds, the memory limit itself, and -- under an SLO -- the largest batch that still meets it (found
by bisection between the grid points, since per-user speed falls as the batch grows). A layout whose weights and one
sequence per group do not fit is not a candidate at all; `why_not` says how far it misses. A candidate is feasible when
its per-user speed is at least `min_user_tok_s` and its TTFT at most `max_ttft_s`; feasible candidates are ranked by $
per 1M output tokens. The per-user speed is what a user sees: with a workload (input/output lengths, a rate) the decode
steps are stretched by the prefill its requests bring (`workload.decode_stretch`); without one, no prefill load is
implied and it is the decode step's own speed. Each batch is priced on an engine set up for it: a CUDA graph captured
at that batch per group (`Efficiency.capturing`), as engines capture their max batch, so a batch between two powers
of two runs its own graph, not the next power's (until issue 37 round six every batch from 65 to 127 ran the graph of
128, and the bisection found nothing between the grid points). With a workload each candidate carries its replica's
busy seconds per request, which `plan.request_rank` orders by.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from openk3.checks import fail
from openk3.config import ModelConfig
from openk3.planner.balance import BalanceParams
from openk3.planner.comm import CommParams
from openk3.planner.energy import PowerParams
from openk3.planner.hardware import System
from openk3.planner.inputs import Balance, Layout, Quantisation, Workload
from openk3.planner.memory import DEFAULT_FILL, MemoryBreakdown, candidate_tps, max_concurrency, tp_problem, working_set
from openk3.planner.perf import Efficiency, Metrics, Scenario, evaluate
from openk3.planner.placement import tp_placement_problem
from openk3.planner.pp_cp import KDASplit, LongPrefill, fix_ttft, with_long_prefill
from openk3.planner.speculative import SpecDecoding
from openk3.planner.workload import RequestMix, decode_stretch, mean_prefill_busy, replicas_for


@dataclass(frozen=True)
class SLO:
    min_user_tok_s: float = 0.0
    max_ttft_s: float = float("inf")

    @property
    def binds(self) -> bool:
        return self.min_user_tok_s > 0 or self.max_ttft_s != float("inf")

    def __post_init__(self) -> None:
        if self.min_user_tok_s < 0:
            fail("SLO", "min_user_tok_s", self.min_user_tok_s, ">= 0")
        if not self.max_ttft_s > 0:
            fail("SLO", "max_ttft_s", self.max_ttft_s, "seconds > 0")


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    seqs_per_group: int  # on the fullest attention-DP group
    concurrency: int  # sequences decoding at once in the instance
    metrics: Metrics
    meets_slo: bool
    miss: str  # why it misses the SLO ("" when it meets it)
    # what sets the batch: "memory" (the HBM limit), "SLO" (one more sequence misses it), "replicas" (one more sequence
    # lets one replica fewer carry the rate, and the extra rate each then serves makes its users miss the SLO: the
    # fleet's edge, not the batch's own speed), "fixed" (asked for)
    batch_cap: str = ""
    long_prefill: LongPrefill | None = None  # PP/CP for the prompt, when the search needed them for the TTFT SLO
    # wall time per decode step / the step itself: the prefill a workload's requests bring interleaves with decode
    # (workload.decode_stretch); 1.0 when no workload is given, or for a decode pool that never prefills
    stretch: float = 1.0
    busy_s: float | None = None  # with a workload: replica-seconds per request (its prefill + its decode steps)
    prefill_busy_s: float | None = None  # with a workload: the prefill part of `busy_s`

    @property
    def user_tok_s(self) -> float:
        """What each user sees: decode steps slowed by the prefill interleaved with them. The per-user SLO is checked on this."""
        return self.metrics.per_user_tok_s / self.stretch

    def describe(self) -> str:
        return self.layout.describe() + (f", prefill {self.long_prefill.describe()}" if self.long_prefill else "")


@dataclass(frozen=True)
class SearchSpace:
    sizes: tuple[int, ...] | None = None  # None: derived from the system
    tps: tuple[int, ...] | None = None  # None: every TP up to 8 that divides the heads and tiles the scale-up domain
    balances: tuple[Balance, ...] = (Balance.EPLB, Balance.MOONEP)
    redundancy: bool = True
    redundant: tuple[int, ...] | None = None  # explicit redundant-expert counts; None: 0, and one per rank when `redundancy`
    max_seqs_per_group: int = 4096
    max_accelerators: int = 288
    max_pp: int = 1  # pipeline stages the search may use for a prompt that misses the TTFT SLO (pp_cp.py)
    max_cp: int = 1  # context-parallel ranks per prompt, likewise
    kda_cp: KDASplit = KDASplit.SEQUENTIAL  # how KDA's recurrence crosses CP ranks

    def __post_init__(self) -> None:
        if self.max_pp < 1:
            fail("SearchSpace", "max_pp", self.max_pp, ">= 1 stage")
        if self.max_cp < 1:
            fail("SearchSpace", "max_cp", self.max_cp, ">= 1 rank")


def default_sizes(system: System, max_accelerators: int) -> tuple[int, ...]:
    unit = system.accelerators_per_unit
    sizes = {2**i for i in range(0, 12)} | {unit * k for k in range(1, 9)}
    return tuple(sorted(s for s in sizes if s <= max_accelerators))


def batch_grid(limit: int, cap: int) -> list[int]:
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
            key = (c.meets_slo, -c.metrics.usd_per_m_output if c.meets_slo else c.user_tok_s)
            if cur is None or key > (cur.meets_slo, -cur.metrics.usd_per_m_output if cur.meets_slo else cur.user_tok_s):
                out[n] = c
        return dict(sorted(out.items()))


def candidate_layouts(config: ModelConfig, system: System, space: SearchSpace) -> Iterable[Layout]:
    sizes = space.sizes or default_sizes(system, space.max_accelerators)
    for n in sizes:
        if space.tps is None:
            tps = candidate_tps(n, system, max_tp=8, config=config)
        else:  # asked for explicitly: still whole groups inside a scale-up domain, never a split head
            tps = [t for t in space.tps if tp_placement_problem(t, n, system) is None and tp_problem(config, t) is None]
        for tp in tps:
            for balance in space.balances:
                if space.redundant is not None:
                    redundant: tuple[int, ...] = space.redundant
                else:
                    redundant = (0, n) if space.redundancy and balance == Balance.EPLB and n > 1 else (0,)
                for r in redundant:
                    yield Layout(num_accelerators=n, tp=tp, redundant_experts=r, balance=balance)


def _refine(limit: int, grid: dict[int, Candidate], make: Callable[[int], Candidate], why: Callable[[Candidate, Candidate], str]) -> Candidate | None:
    """The largest batch meeting the SLO between the largest feasible grid point and the next one (bisection: the SLO
    terms only get worse as the batch grows), its `batch_cap` set by `why(it, the batch one above it)`."""
    ok = [b for b, c in grid.items() if c.meets_slo]
    if not ok:
        return None
    lo = max(ok)
    above = [b for b in grid if b > lo]
    hi = min(above) if above else limit + 1
    best, miss = None, grid.get(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        c = make(mid)
        if c.meets_slo:
            lo, best = mid, c
        else:
            hi, miss = mid, c
    if best is None:
        return None
    return replace(best, batch_cap=why(best, miss) if miss is not None else "SLO")


def cap_reason(slo: SLO, rate: float | None) -> Callable[[Candidate, Candidate], str]:
    """Why the batch stops at `ok` when `one_more` (the next batch) misses the SLO: "replicas" when a rate is given,
    `one_more`'s replica carries enough of it that the rate needs one replica fewer, and `one_more` misses only the
    per-user speed, which it would meet at `ok`'s share of the rate; "SLO" otherwise (the batch's own speed or TTFT)."""

    def why(ok: Candidate, one_more: Candidate) -> str:
        if rate is None or ok.busy_s is None or one_more.busy_s is None:
            return "SLO"
        fewer = replicas_for(rate, one_more.busy_s) < replicas_for(rate, ok.busy_s)
        at_ok_share = one_more.metrics.per_user_tok_s / ok.stretch >= slo.min_user_tok_s and one_more.metrics.ttft_s <= slo.max_ttft_s
        return "replicas" if fewer and at_ok_share else "SLO"

    return why


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
    concurrency: int | None = None,
    power: PowerParams | None = None,
    mix: RequestMix | None = None,
    spec: SpecDecoding | None = None,
) -> SearchResult:
    """Every layout of `space` that holds the weights and its batch; `concurrency` fixes the instance's batch instead of
    searching it. With a workload `mix`, every candidate's per-user speed is what its users see with the mix's prefill
    interleaved at the mix's rate (full capacity without one), and the SLO is checked on that."""
    slo, space = slo or SLO(), space or SearchSpace()
    efficiency, comm, balance, power = efficiency or Efficiency(), comm or CommParams(), balance or BalanceParams(), power or PowerParams()
    out: list[Candidate] = []
    for layout in candidate_layouts(config, system, space):
        limit = max_concurrency(config, quant, layout, context, system, fill, state_copies=spec.state_copies if spec else 1) // layout.dp
        prefill_busy = None
        if mix is not None and limit >= 1:  # replica-seconds of prefill per request: the layout's, whatever the batch
            probe = Scenario(
                config, quant, layout, Workload(context=context, concurrency=layout.dp, prompt=prompt), system, efficiency, comm, balance, fill, power, spec
            )
            prefill_busy = mean_prefill_busy(probe, mix)

        def make(b: int, total: int | None = None, layout: Layout = layout, limit: int = limit, prefill_busy: float | None = prefill_busy) -> Candidate:
            # memory binds a searched batch that is the HBM limit itself; a batch the caller fixed is its own choice
            capped = total is None and b >= limit
            cap = "fixed" if total is not None else ("memory" if capped else "")
            total = b * layout.dp if total is None else total
            workload = Workload(context=context, concurrency=total, prompt=prompt)
            engine = efficiency.capturing(b)  # the engine set up for this batch captures its graph
            sc = Scenario(config, quant, layout, workload, system, engine, comm, balance, fill, power, spec)
            m = evaluate(sc, memory_limited=capped)
            lp = None
            if m.ttft_s > slo.max_ttft_s and (space.max_pp > 1 or space.max_cp > 1):
                lp = fix_ttft(sc, slo.max_ttft_s, space.max_pp, space.max_cp, space.kda_cp)
                if lp is not None and lp.ttft_s < m.ttft_s:
                    m = with_long_prefill(m, lp)
                else:
                    lp = None
            stretch, busy = 1.0, None
            if mix is not None and prefill_busy is not None:
                stretch = decode_stretch(prefill_busy, mix.mean_output / m.throughput_tok_s, mix.rate)
                busy = prefill_busy + mix.mean_output / m.throughput_tok_s
            user = m.per_user_tok_s / stretch
            miss = []
            if user < slo.min_user_tok_s:
                seen = f" with prefill interleaved ({m.per_user_tok_s:.1f} on decode steps alone)" if stretch > 1 else ""
                miss.append(f"{user:.1f} tok/s/user{seen} < {slo.min_user_tok_s:g}")
            if m.ttft_s > slo.max_ttft_s:
                miss.append(f"TTFT {m.ttft_s:.2f}s > {slo.max_ttft_s:g}s")
            return Candidate(layout, b, total, m, not miss, "; ".join(miss), cap, lp, stretch, busy, prefill_busy if busy is not None else None)

        if concurrency is not None:
            b = -(-concurrency // layout.dp)
            if 1 <= b <= limit:
                out.append(make(b, concurrency))
            continue
        if limit < 1:
            continue
        grid = {b: make(b) for b in batch_grid(limit, space.max_seqs_per_group)}
        out.extend(grid.values())
        why = cap_reason(slo, mix.rate if mix is not None else None)
        refined = _refine(min(limit, space.max_seqs_per_group), grid, make, why) if slo.binds else None
        if refined is not None:
            out.append(refined)
    return SearchResult(tuple(out))


@dataclass(frozen=True)
class Misfit:
    """The layout of one instance size that comes closest to holding the weights and the batch, and by how much it misses."""

    layout: Layout
    concurrency: int
    memory: MemoryBreakdown

    def describe(self, context: int) -> str:
        m = self.memory
        return (
            f"{self.layout.describe()} does not fit: {self.concurrency:,} sequence{'' if self.concurrency == 1 else 's'} of {context:,} tokens need "
            f"{m.total / 1e9:,.1f} GB per accelerator (weights {m.weights / 1e9:,.1f} GB, cache {m.cache / 1e9:,.1f} GB) "
            f"> {m.capacity / 1e9:,.1f} GB usable"
        )


def why_not(
    config: ModelConfig,
    quant: Quantisation,
    system: System,
    context: int,
    sizes: Sequence[int],
    fill: float = DEFAULT_FILL,
    tps: Sequence[int] | None = None,
    concurrency: int | None = None,
    balances: Sequence[Balance] = (Balance.EPLB,),
) -> dict[int, Misfit]:
    """For each size where no layout holds the weights and the batch (`concurrency`, else one sequence per DP group):
    the closest layout. Sizes where something fits are left out."""
    out: dict[int, Misfit] = {}
    for n in sizes:
        options = (
            candidate_tps(n, system, config=config)
            if tps is None
            else [t for t in tps if tp_placement_problem(t, n, system) is None and tp_problem(config, t) is None]
        )
        closest: Misfit | None = None
        fits = False
        for tp in options:
            for b in balances:
                layout = Layout(n, tp=tp, balance=b)
                c = layout.dp if concurrency is None else concurrency
                ws = working_set(config, quant, layout, Workload(context=context, concurrency=c), system, fill)
                fits = fits or ws.fits
                if closest is None or ws.total - ws.capacity < closest.memory.total - closest.memory.capacity:
                    closest = Misfit(layout, c, ws)
        if closest is not None and not fits:
            out[n] = closest
    return out
