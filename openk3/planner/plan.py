"""One call that answers the user's question: does it fit, on how many accelerators, how fast, at what cost, and why.

`make_plan` gathers every section the report prints (weights, cache per sequence, minimum accelerators, the chosen
layout's memory and step breakdown, maximum concurrency, the SLO search, the offload tiers); `report.py` only renders.

The headline is the cheapest candidate that meets every constraint: the SLO and whatever the request pins (size, TP,
balance, redundant experts, concurrency); what it leaves open is searched. When no candidate qualifies there is no
headline: `problem` says why (the closest layout's memory, or the best speed and TTFT any fitting layout reaches), and
no speed or cost is reported for a layout that does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from openk3.planner.agent import TaskCost, task_cost
from openk3.planner.disagg import Comparison, compare
from openk3.planner.fleet import Fleet, best_fleet, slo_rate
from openk3.planner.inputs import Balance, Layout, Workload
from openk3.planner.memory import MemoryBreakdown, WeightBytes, cache_spec, max_concurrency, min_accelerators, weight_bytes
from openk3.planner.pareto import FrontRow, pareto_rows
from openk3.planner.perf import Metrics, Scenario
from openk3.planner.queueing import QueueStats, SLOPercentile, replica_queue
from openk3.planner.request import PlanRequest
from openk3.planner.runtime import Support, support
from openk3.planner.search import SLO, Candidate, SearchResult, SearchSpace, default_sizes, search, why_not
from openk3.planner.tiers import TierRow, break_even_tokens, tier_table
from openk3.planner.traffic import Traffic, step_traffic
from openk3.planner.workload import Demand, demand, replicas_for


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    weights: WeightBytes
    mla_bytes_per_token: int
    kda_bytes_per_sequence: int
    min_for_weights: Layout | None
    min_for_workload: Layout | None
    search: SearchResult  # the whole space, for the tables
    choice: Candidate | None  # the headline; None when nothing meets every constraint
    problem: str | None  # why there is no headline
    layout: Layout | None  # the headline's layout, else the closest one that does not fit (when that is the problem)
    memory: MemoryBreakdown | None  # of `layout`
    workload: Workload
    max_concurrency: int
    tiers: tuple[TierRow, ...]
    break_even: dict[str, int | None]
    demand: Demand | None = None  # with a workload: replicas, accelerators, $ per request, times per request
    traffic: Traffic | None = None  # the headline's decode-step bytes by flow (weights, KV/state, all-to-all up/out)
    front: tuple[FrontRow, ...] = ()  # every candidate of the whole search, flagged feasible / on the Pareto front
    disagg: Comparison | None = None  # with `disaggregate`: best xPyD vs best aggregated under the same SLO and rate
    agent: TaskCost | None = None  # with an agent task: its $ and accelerator-seconds on the headline's replica
    queue: tuple[QueueStats, SLOPercentile] | None = None  # with --rate: simulated TTFT/TPOT percentiles and the one the SLO meets
    fleet: Fleet | None = None  # with --rate: the fleet of fewest accelerators, a remainder replica of a smaller layout allowed
    headline_slo_rps: float | None = None  # with --rate: the most requests/s one headline replica serves within the SLO

    @property
    def metrics(self) -> Metrics | None:
        return self.choice.metrics if self.choice else None

    @property
    def support(self) -> Support | None:
        if self.layout is None:
            return None
        lp = self.choice.long_prefill if self.choice else None
        return support(self.layout, self.request.efficiency.comm_overlap, self.request.quant, self.request.system.accelerator.vendor, lp)


def request_rank(c: Candidate, rate: float | None) -> tuple[float, float]:
    """How a workload's candidates are ordered (the headline and the search rows): with a rate, by the accelerators of
    the ceil(rate / per-replica rate) replicas it needs, then by accelerator-seconds per request; without one, by
    accelerator-seconds per request at full utilisation (both are $ at the system's one price per accelerator-hour)."""
    if c.busy_s is None:
        raise ValueError(f"request_rank needs a candidate searched with a workload ({c.describe()} has no busy seconds per request)")
    full_use = c.layout.num_accelerators * c.busy_s
    if rate is None:
        return (full_use, 0.0)
    return (float(replicas_for(rate, c.busy_s) * c.layout.num_accelerators), full_use)


def ranking_rule(rate: float | None) -> str:
    """The order `request_rank` gives, in words for the reports."""
    if rate is None:
        return "cheapest per request at full utilisation first"
    return f"cheapest fleet for {rate:g} requests/s first (ceil(rate / per-replica rate) replicas), then per request at full utilisation"


def _pinned_space(req: PlanRequest, sizes: tuple[int, ...]) -> SearchSpace:
    s = req.space
    return replace(
        s,
        sizes=(req.accelerators,) if req.accelerators is not None else sizes,
        tps=(req.tp,) if req.tp is not None else s.tps,
        balances=(req.balance,) if req.balance is not None else s.balances,
        redundant=(req.redundant_experts,) if req.redundant_experts is not None else s.redundant,
    )


def _slo_problem(result: SearchResult, slo: SLO) -> str:
    fastest = max(result.candidates, key=lambda c: c.user_tok_s)
    quickest = min(result.candidates, key=lambda c: c.metrics.ttft_s)
    parts = [f"no layout meets the SLO (>= {slo.min_user_tok_s:g} tok/s per user, TTFT <= {slo.max_ttft_s:g} s)"]
    parts.append(
        f"the fastest fitting candidate reaches {fastest.user_tok_s:.1f} tok/s per user ({fastest.layout.describe()}, {fastest.concurrency:,} sequences)"
    )
    parts.append(f"the lowest TTFT is {quickest.metrics.ttft_s:.2f} s ({quickest.layout.describe()})")
    return "; ".join(parts)


def make_plan(req: PlanRequest) -> Plan:
    spec = cache_spec(req.config, req.quant)
    weights_only = Workload(context=req.context, concurrency=0)
    asked = {req.accelerators} if req.accelerators is not None else set()
    sizes = tuple(sorted(set(req.space.sizes or default_sizes(req.system, req.space.max_accelerators)) | asked))

    def run(space: SearchSpace, concurrency: int | None) -> SearchResult:
        return search(
            req.config, req.quant, req.system, req.context, req.slo, req.prompt, space,
            req.efficiency, req.comm, req.balance_params, req.fill, concurrency=concurrency, power=req.power, mix=req.requests, spec=req.spec,
        )  # fmt: skip

    full = run(replace(req.space, sizes=sizes), None)
    pinned_space = _pinned_space(req, sizes)
    result = run(pinned_space, req.concurrency) if req.pinned else full
    choice = result.best
    if req.requests is not None and result.feasible:
        rate = req.requests.rate
        choice = min(result.feasible, key=lambda c: request_rank(c, rate))
    balance = req.balance or Balance.EPLB
    problem: str | None = None
    layout: Layout | None = None
    memory: MemoryBreakdown | None = None
    if choice is not None:
        layout, memory = choice.layout, choice.metrics.memory
    elif result.candidates:
        problem = _slo_problem(result, req.slo)
    else:
        misfits = why_not(
            req.config, req.quant, req.system, req.context, pinned_space.sizes or sizes, req.fill, pinned_space.tps, req.concurrency, pinned_space.balances
        )
        if misfits:
            closest = min(misfits.values(), key=lambda m: m.memory.total - m.memory.capacity)
            layout, memory = closest.layout, closest.memory
            limit = max_concurrency(req.config, req.quant, closest.layout, req.context, req.system, req.fill)
            room = f"; at most {limit:,} sequences fit" if req.concurrency is not None and limit else ""
            problem = closest.describe(req.context) + room
        else:
            problem = "no layout in the search space fits"
    concurrency = choice.concurrency if choice else (req.concurrency or (layout.dp if layout else 1))
    workload = Workload(context=req.context, concurrency=concurrency, prompt=req.prompt)
    tiers: tuple[TierRow, ...] = ()
    break_even: dict[str, int | None] = {}
    sized: Demand | None = None
    traffic: Traffic | None = None
    agent: TaskCost | None = None
    queue: tuple[QueueStats, SLOPercentile] | None = None
    fleet: Fleet | None = None
    headline_slo_rps: float | None = None
    if choice is not None and req.requests is not None and req.requests.rate is not None:
        fleet = best_fleet(result.candidates, req.slo, req.requests.rate)
        headline_slo_rps = slo_rate(choice, req.slo)
    if choice is not None and layout is not None:
        engine = req.efficiency.capturing(choice.seqs_per_group)  # as the search priced it: a graph at the planned batch
        sc = Scenario(req.config, req.quant, layout, workload, req.system, engine, req.comm, req.balance_params, req.fill, req.power, req.spec)
        tiers = tier_table(sc, req.context)
        break_even = {t: break_even_tokens(sc, t) for t in ("host_dram", "nvme")}
        sized = demand(sc, choice.metrics, req.requests, choice.long_prefill) if req.requests is not None else None
        traffic = step_traffic(sc, choice.metrics.decode)
        agent = task_cost(sc, req.agent) if req.agent is not None else None
        if sized is not None and sized.replicas is not None and req.requests is not None and req.requests.rate is not None:
            stats = replica_queue(sc, req.requests.pairs, req.queue.at(req.requests.rate / sized.replicas))
            queue = (stats, SLOPercentile.of(stats, req.slo.max_ttft_s, req.slo.min_user_tok_s))
    return Plan(
        request=req,
        weights=weight_bytes(req.config, req.quant),
        mla_bytes_per_token=spec.mla.bytes_per_token,
        kda_bytes_per_sequence=spec.kda.bytes_per_sequence,
        min_for_weights=min_accelerators(req.config, req.quant, weights_only, req.system, balance, req.fill),
        min_for_workload=min_accelerators(req.config, req.quant, workload, req.system, balance, req.fill),
        search=full,
        choice=choice,
        problem=problem,
        layout=layout,
        memory=memory,
        workload=workload,
        max_concurrency=max_concurrency(req.config, req.quant, layout, req.context, req.system, req.fill, 2 if req.spec else 1) if layout else 0,
        tiers=tiers,
        break_even=break_even,
        demand=sized,
        traffic=traffic,
        agent=agent,
        queue=queue,
        fleet=fleet,
        headline_slo_rps=headline_slo_rps,
        front=pareto_rows(full.candidates),
        disagg=compare(req) if req.disaggregate else None,
    )
