"""The plan as a JSON document: every input echoed (prices and their sources, SLO, efficiencies, quantisation, power
model, catalogue figures), the headline or the reason there is none, and every candidate of the search. Only finite
numbers: a non-finite value is null."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any

from openk3.planner.inputs import Workload
from openk3.planner.pareto import front
from openk3.planner.perf import Scenario
from openk3.planner.plan import Plan, ranking_rule
from openk3.planner.report_disagg import comparison_json
from openk3.planner.runtime import support
from openk3.planner.search import Candidate
from openk3.planner.traffic import step_traffic


def _candidate_json(c: Candidate, plan: Plan, on_front: frozenset[int] = frozenset()) -> dict[str, Any]:
    m = c.metrics
    runs = support(c.layout, plan.request.efficiency.comm_overlap, plan.request.quant, plan.request.system.accelerator.vendor, c.long_prefill)
    return {
        "layout": c.describe(),
        "accelerators": c.layout.num_accelerators,
        "tp": c.layout.tp,
        "ep": c.layout.ep_size,
        "redundant_experts": c.layout.redundant_experts,
        "balance": c.layout.balance.value,
        "seqs_per_group": c.seqs_per_group,
        "concurrency": c.concurrency,
        "per_user_tok_s": c.user_tok_s,  # what users see: the SLO is checked on this
        "decode_step_tok_s": m.per_user_tok_s,
        "decode_stretch": c.stretch,
        "ttft_s": m.ttft_s,
        "tok_s_per_accelerator": m.per_accelerator_tok_s,
        "usd_per_m_output": m.usd_per_m_output,
        "usd_per_m_input": m.usd_per_m_input,
        "tokens_per_joule": m.tokens_per_joule,
        "binding": m.binding,
        "step_dominated_by": m.decode.dominant,
        "meets_slo": c.meets_slo,
        "pareto": id(c) in on_front,
        "miss": c.miss,
        "batch_cap": c.batch_cap or None,
        "long_prefill": None if c.long_prefill is None else dataclasses.asdict(c.long_prefill),
        "traffic": _traffic(c, plan),
        "runnable": {"openk3": runs.openk3, "openk3_missing": list(runs.openk3_missing), "engines": list(runs.engines)},
    }


def _traffic(c: Candidate, plan: Plan) -> dict[str, float]:
    """The candidate's decode-step bytes by flow on its busiest rank (the same counts as the headline's `traffic`)."""
    req = plan.request
    workload = Workload(context=req.context, concurrency=c.concurrency, prompt=req.prompt)
    sc = Scenario(req.config, req.quant, c.layout, workload, req.system, req.efficiency, req.comm, req.balance_params, req.fill, req.power, req.spec)
    t = step_traffic(sc, c.metrics.decode)
    return {"weights": t.weights, "kv_state": t.kv_state, "a2a_scale_up": t.a2a_scale_up, "a2a_scale_out": t.a2a_scale_out}


def _demand(plan: Plan) -> dict[str, Any] | None:
    d = plan.demand
    if d is None:
        return None
    out = {k: v for k, v in dataclasses.asdict(d).items() if k != "mix"}
    return out | {"accelerators": d.accelerators, "decode_context": d.mix.decode_context, "ttft_prompt": d.mix.ttft_prompt}


def _fleet(plan: Plan) -> dict[str, Any] | None:
    f = plan.fleet
    if f is None:
        return None
    parts = [
        {
            "candidate": _candidate_json(p.candidate, plan),
            "replicas": p.replicas,
            "served_rps": p.served_rps,
            "slo_rps": p.slo_rps,
            "user_tok_s": p.user_tok_s(),
        }
        for p in f.parts
    ]
    return {"accelerators": f.accelerators, "usd_per_request": f.usd_per_request(plan.request.system.price_per_hour), "parts": parts}


def _figures(obj: Any, skip: tuple[str, ...]) -> dict[str, Any]:
    sources = getattr(obj, "sources", {})
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if f.name in skip:
            continue
        value = getattr(obj, f.name)
        out[f.name] = {"value": value, "source": sources.get(f.name)} if f.name in sources else value
    return out


def _inputs(plan: Plan) -> dict[str, Any]:
    req = plan.request
    system = req.system
    return {
        "model": req.config.name,
        "hardware": system.name,
        "context": req.context,
        "prompt": plan.workload.prompt_tokens,
        "concurrency": req.concurrency,
        "accelerators": req.accelerators,
        "tp": req.tp,
        "balance": req.balance.value if req.balance else None,
        "redundant_experts": req.redundant_experts,
        "slo": dataclasses.asdict(req.slo),
        "price": {
            "usd_per_accelerator_hour": system.price_per_hour,
            "source": system.sources.get("price_per_hour"),
            "placeholder": system.price_is_placeholder,
        },
        "quantisation": dataclasses.asdict(req.quant),
        "efficiency": {**dataclasses.asdict(req.efficiency), "overheads": dataclasses.asdict(req.efficiency.step_overheads)},
        "speculative": None if req.spec is None else dataclasses.asdict(req.spec) | {"tokens_per_iteration": req.spec.tokens_per_iteration},
        "comm": dataclasses.asdict(req.comm),
        "balance_params": dataclasses.asdict(req.balance_params),
        "power": dataclasses.asdict(req.power) | {"note": "fractions of TDP by step phase; estimates"},
        "fill": req.fill,
        "search_space": dataclasses.asdict(req.space),
        "system": _figures(system, skip=("name", "accelerator", "sources")),
        "accelerator": {"name": system.accelerator.name} | _figures(system.accelerator, skip=("name", "sources")),
    }


def _finite(x: Any) -> Any:
    """JSON has no Infinity or NaN: a non-finite number becomes null; enums become their values."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, enum.Enum):
        return x.value
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def render_json(plan: Plan) -> dict[str, Any]:
    req, m = plan.request, plan.metrics
    pc = req.config.param_count()
    layout = plan.layout
    on_front = frozenset(id(r.candidate) for r in plan.front if r.pareto)
    doc: dict[str, Any] = {
        "model": req.config.name,
        "hardware": req.system.name,
        "context": plan.workload.context,
        "inputs": _inputs(plan),
        "problem": plan.problem,
        "params": {"total": pc.total, "active": pc.active},
        "weights": {"routed_bytes": plan.weights.routed_bytes, "trunk_bytes": plan.weights.trunk_bytes, "checkpoint_bytes": plan.weights.checkpoint_bytes},
        "cache": {"mla_bytes_per_token": plan.mla_bytes_per_token, "kda_bytes_per_sequence": plan.kda_bytes_per_sequence},
        "min_accelerators": {
            "weights": plan.min_for_weights.num_accelerators if plan.min_for_weights else None,
            "workload": plan.min_for_workload.num_accelerators if plan.min_for_workload else None,
        },
        "layout": None
        if layout is None
        else {
            "describe": layout.describe(),
            "accelerators": layout.num_accelerators,
            "tp": layout.tp,
            "ep": layout.ep_size,
            "redundant_experts": layout.redundant_experts,
            "balance": layout.balance.value,
            "fits": plan.memory.fits if plan.memory else None,
        },
        "runnable": None
        if plan.support is None
        else {"openk3": plan.support.openk3, "openk3_missing": list(plan.support.openk3_missing), "engines": list(plan.support.engines)},
        "concurrency": plan.workload.concurrency,
        "max_concurrency": plan.max_concurrency,
        "memory": None if plan.memory is None else plan.memory.as_dict() | {"fits": plan.memory.fits},
        "decode": None,
        "metrics": None,
        "search": {
            "best": _candidate_json(plan.search.best, plan) if plan.search.best else None,
            "per_size": [_candidate_json(c, plan) for c in plan.search.best_per_size().values()],
            "candidates": [_candidate_json(c, plan, on_front) for c in plan.search.candidates],
        },
        # the SLO-constrained front of the whole search, fastest per user first (the same rows as in candidates)
        "pareto": [_candidate_json(r.candidate, plan, on_front) for r in front(plan.front)],
        "traffic": None if plan.traffic is None else plan.traffic.as_dict() | {"per": "decode step, busiest rank; fabric bytes sent + received"},
        "tiers": [
            {
                "tier": r.tier,
                "bandwidth": r.bandwidth,
                "capacity": r.capacity,
                "prefixes": r.sequences,
                "reload_s": r.reload_s,
                "recompute_s": r.recompute_s,
                "pays_off": r.pays_off,
            }
            for r in plan.tiers
        ],
        "break_even_tokens": plan.break_even,
    }
    if m is not None:
        doc["decode"] = {
            "step_s": m.decode.total_s,
            "comm_s": m.decode.comm_s,
            "exposed_comm_s": m.decode.exposed_comm_s,
            "imbalance": m.decode.imbalance,
            "components": [{"name": c.name, "bytes": c.bytes, "flops": c.flops, "time_s": c.time_s, "bound": c.bound} for c in m.decode.components],
        }
        doc["metrics"] = {
            "throughput_tok_s": m.throughput_tok_s,
            "per_user_tok_s": plan.choice.user_tok_s if plan.choice else m.per_user_tok_s,  # what users see: the SLO is checked on this
            "decode_step_tok_s": m.per_user_tok_s,
            "decode_stretch": plan.choice.stretch if plan.choice else 1.0,
            "ttft_s": m.ttft_s,
            "prefill_tok_s": m.prefill_tok_s,
            "tokens_per_joule": m.tokens_per_joule,
            "prefill_tokens_per_joule": m.prefill_tokens_per_joule,
            "decode_power_w": m.decode_power_w,
            "prefill_power_w": m.prefill_power_w,
            "usd_per_m_output": m.usd_per_m_output,
            "usd_per_m_input": m.usd_per_m_input,
            "price_is_placeholder": req.system.price_is_placeholder,
            "binding": m.binding,
        }
    if req.requests is not None:
        doc["workload"] = {
            "pairs": [list(p) for p in req.requests.pairs],
            "rate": req.requests.rate,
            "ranking": ranking_rule(req.requests.rate),
            "demand": _demand(plan),
            "headline_slo_rps": plan.headline_slo_rps,
            "fleet": _fleet(plan),
        }
    if plan.queue is not None:
        stats, met = plan.queue
        doc["queueing"] = {
            "arrivals": stats.spec.arrivals.value, "cv2": stats.spec.cv2, "rate_per_replica": stats.spec.rate,
            "requests": stats.spec.requests, "seed": stats.spec.seed, "busy": stats.utilisation, "max_queue": stats.max_queue,
            "ttft_s": dataclasses.asdict(stats.ttft), "tpot_s": None if stats.tpot is None else dataclasses.asdict(stats.tpot),
            "slo_met_at": met.percentile,
        }  # fmt: skip
    if plan.agent is not None:
        a = plan.agent
        doc["agent_task"] = dataclasses.asdict(a.task) | {
            "usd": a.usd, "accelerator_seconds": a.gpu_s, "wall_s": a.wall_s,
            "shares": {p: a.share(p) for p in ("prefill", "decode", "hold")},
            "per_turn": [dataclasses.asdict(t) for t in a.turns],
        }  # fmt: skip
    if plan.disagg is not None:
        doc["disaggregation"] = comparison_json(plan.disagg)
    return _finite(doc)  # type: ignore[no-any-return]
