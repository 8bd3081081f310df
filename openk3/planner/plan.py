"""One call that answers the user's question: does it fit, on how many accelerators, how fast, at what cost, and why.

`make_plan` gathers every section the report prints (weights, cache per sequence, minimum accelerators, the chosen
layout's memory and step breakdown, maximum concurrency, the SLO search, the offload tiers); `report.py` only renders.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from openk3.config import ModelConfig
from openk3.planner.balance import BalanceParams
from openk3.planner.comm import CommParams
from openk3.planner.hardware import System
from openk3.planner.inputs import Balance, Layout, Quantisation, Workload
from openk3.planner.memory import DEFAULT_FILL, WeightBytes, cache_spec, max_concurrency, min_accelerators, weight_bytes
from openk3.planner.perf import Efficiency, Metrics, Scenario, evaluate
from openk3.planner.search import SLO, SearchResult, SearchSpace, default_sizes, search
from openk3.planner.tiers import TierRow, break_even_tokens, tier_table


@dataclass(frozen=True)
class PlanRequest:
    config: ModelConfig
    system: System
    context: int
    concurrency: int | None = None  # None: as many as the chosen layout holds at this context
    prompt: int | None = None
    quant: Quantisation = field(default_factory=Quantisation)
    accelerators: int | None = None  # None: one system unit, or the fewest whole units that hold the weights
    tp: int | None = None  # None: the cheapest TP for that size found by the search
    balance: Balance = Balance.EPLB
    redundant_experts: int = 0
    slo: SLO = field(default_factory=SLO)
    efficiency: Efficiency = field(default_factory=Efficiency)
    comm: CommParams = field(default_factory=CommParams)
    balance_params: BalanceParams = field(default_factory=BalanceParams)
    fill: float = DEFAULT_FILL
    space: SearchSpace = field(default_factory=SearchSpace)


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    weights: WeightBytes
    mla_bytes_per_token: int
    kda_bytes_per_sequence: int
    min_for_weights: Layout | None
    min_for_workload: Layout | None
    layout: Layout
    workload: Workload
    metrics: Metrics
    max_concurrency: int
    search: SearchResult
    tiers: tuple[TierRow, ...]
    break_even: dict[str, int | None]


def _default_size(req: PlanRequest) -> int:
    if req.accelerators is not None:
        return req.accelerators
    unit = req.system.accelerators_per_unit
    weights_only = Workload(context=req.context, concurrency=0)
    smallest = min_accelerators(req.config, req.quant, weights_only, req.system, req.balance, req.fill)
    need = smallest.num_accelerators if smallest else unit
    return unit * math.ceil(need / unit)


def _choose_tp(req: PlanRequest, n: int, result: SearchResult) -> int:
    if req.tp is not None:
        return req.tp
    same = [c for c in result.candidates if c.layout.num_accelerators == n and c.layout.balance == req.balance]
    good = sorted((c for c in same if c.meets_slo), key=lambda c: c.metrics.usd_per_m_output)
    if good:
        return good[0].layout.tp
    return 1 if n <= req.system.scale_up_domain else 8


def make_plan(req: PlanRequest) -> Plan:
    spec = cache_spec(req.config, req.quant)
    weights_only = Workload(context=req.context, concurrency=0)
    n = _default_size(req)
    # the instance the user asked about is always among the searched sizes, so its TP choice is a searched one
    sizes = tuple(sorted(set(req.space.sizes or default_sizes(req.system, req.space.max_accelerators)) | {n}))
    space = replace(req.space, sizes=sizes)
    result = search(req.config, req.quant, req.system, req.context, req.slo, req.prompt, space, req.efficiency, req.comm, req.balance_params, req.fill)
    tp = _choose_tp(req, n, result)
    layout = Layout(num_accelerators=n, tp=tp, redundant_experts=req.redundant_experts, balance=req.balance)
    limit = max_concurrency(req.config, req.quant, layout, req.context, req.system, req.fill)
    concurrency = req.concurrency if req.concurrency is not None else max(limit, layout.dp)
    workload = Workload(context=req.context, concurrency=concurrency, prompt=req.prompt)
    sc = Scenario(req.config, req.quant, layout, workload, req.system, req.efficiency, req.comm, req.balance_params, req.fill)
    metrics = evaluate(sc, memory_limited=req.concurrency is None)
    min_work = min_accelerators(req.config, req.quant, workload, req.system, req.balance, req.fill)
    return Plan(
        request=req,
        weights=weight_bytes(req.config, req.quant),
        mla_bytes_per_token=spec.mla.bytes_per_token,
        kda_bytes_per_sequence=spec.kda.bytes_per_sequence,
        min_for_weights=min_accelerators(req.config, req.quant, weights_only, req.system, req.balance, req.fill),
        min_for_workload=min_work,
        layout=layout,
        workload=workload,
        metrics=metrics,
        max_concurrency=limit,
        search=result,
        tiers=tier_table(sc, req.context),
        break_even={t: break_even_tokens(sc, t) for t in ("host_dram", "nvme")},
    )
