"""Render a `Plan`: readable text tables, a JSON document, and (optionally, with matplotlib, `plot.py`) charts.

Numbers are printed at a precision that does not mislead (449 MB is "449.4 MB", not "0.4 GB"); a placeholder price is
marked wherever a cost is printed; a layout that does not fit is shown only as the memory that explains why. The JSON
document echoes every input (prices and their sources, SLO, efficiencies, quantisation, power model, catalogue figures)
and holds every candidate of the search; it contains only finite numbers (a non-finite value is null).
"""

from __future__ import annotations

from openk3.planner.agent import describe_cost
from openk3.planner.attention import attention_shape
from openk3.planner.dtypes import describe as describe_quant
from openk3.planner.fleet import describe as describe_fleet
from openk3.planner.pareto import front
from openk3.planner.plan import Plan, ranking_rule, request_rank
from openk3.planner.plot import PlotUnavailable, write_plot
from openk3.planner.queueing import describe_queue
from openk3.planner.report_disagg import comparison_lines
from openk3.planner.report_json import render_json
from openk3.planner.runtime import support
from openk3.planner.search import Candidate
from openk3.planner.workload import describe as describe_demand
from openk3.planner.workload import replicas_for

__all__ = ["PlotUnavailable", "render_json", "render_text", "write_plot"]


def _size(x: float) -> str:
    """Bytes in the unit that keeps three significant figures: 449.4 MB, 27.6 GB, 1,559.9 GB."""
    if x == 0:
        return "0 B"
    if abs(x) < 1e6:
        return f"{x / 1e3:,.1f} kB"
    if abs(x) < 1e9:
        return f"{x / 1e6:,.1f} MB"
    return f"{x / 1e9:,.1f} GB"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _price_note(plan: Plan) -> str:
    return " [placeholder price: no published rate; set --price]" if plan.request.system.price_is_placeholder else ""


def _candidate_row(c: Candidate, plan: Plan) -> list[str]:
    m = c.metrics
    runs = support(c.layout, plan.request.efficiency.comm_overlap, plan.request.quant, plan.request.system.accelerator.vendor, c.long_prefill)
    return [
        c.describe(),
        str(c.seqs_per_group),
        f"{c.user_tok_s:.1f}",
        f"{m.ttft_s:.2f}",
        f"{m.per_accelerator_tok_s:,.0f}",
        f"{m.usd_per_m_output:.3f}" + ("*" if plan.request.system.price_is_placeholder else ""),
        m.binding,
        m.decode.dominant,
        "yes" if runs.openk3 else "no",
        c.miss or "ok",
    ]


HEADERS = ["layout", "seqs/group", "tok/s/user", "TTFT s", "tok/s/acc", "$/1M out", "binding", "step dominated by", "openk3", "SLO"]


def _header(plan: Plan) -> list[str]:
    req, w = plan.request, plan.weights
    acc = req.system.accelerator
    pc = req.config.param_count()
    q, e = req.quant, req.efficiency
    ctx = plan.workload.context
    mw, mk = plan.min_for_weights, plan.min_for_workload
    kv_name = "MLA latent" if attention_shape(req.config).kind == "mla" else "GQA K/V"
    return [
        f"openk3 plan: {req.config.name} on {req.system.name} ({acc.name}, {_size(acc.usable_hbm)} usable HBM, "
        f"{acc.hbm_bw / 1e12:.2f} TB/s, ${req.system.price_per_hour:.2f}/acc-h{_price_note(plan)})",
        f"parameters {pc.total / 1e12:.3f}T total, {pc.active / 1e9:.1f}B active; checkpoint {_size(w.checkpoint_bytes)} "
        f"= routed experts {_size(w.routed_bytes)} ({q.expert_bits:g} bit) + rest {_size(w.trunk_bytes)} ({q.trunk_bits:g} bit)",
        f"cache per sequence at {ctx:,} tokens: {kv_name} {plan.mla_bytes_per_token:,} B/token -> {_size(ctx * plan.mla_bytes_per_token)}"
        f", KDA state + conv {_size(plan.kda_bytes_per_sequence)}",
        f"minimum accelerators (TP dividing the heads): weights only {mw.num_accelerators if mw else 'n/a'} (fill {req.fill:.0%}); "
        f"weights + {plan.workload.concurrency:,} sequences: {mk.num_accelerators if mk else '> search limit'}",
        f"inputs: kernels {e.kernels}"
        + (
            f" ({e.step_overheads.host_gap_s * 1e3:g} ms + {e.step_overheads.host_gap_per_seq_s * 1e6:g} us/sequence host gap per step)"
            if e.step_overheads.host_gap(1) > 0
            else ""
        )
        + f", efficiency hbm {e.hbm:g}, gemm {e.gemm:g}, attention {e.attention:g}, comm overlap {e.comm_overlap:g}; "
        f"{describe_quant(q)}; power x TDP compute {req.power.compute:g} / HBM {req.power.hbm:g} / idle {req.power.idle:g} [estimates]",
    ]


def _memory_table(plan: Plan) -> str:
    assert plan.memory is not None
    mem = plan.memory.as_dict()
    return _table(["memory per accelerator", "bytes"], [[k, _size(v)] for k, v in mem.items()])


def _search_tables(plan: Plan) -> list[str]:
    slo = plan.request.slo
    mix = plan.request.requests
    feasible = list(plan.search.feasible)
    if mix is None:
        out = [f"search (SLO: >= {slo.min_user_tok_s:g} tok/s per user, TTFT <= {slo.max_ttft_s:g} s), cheapest first:"]
    else:  # ranked as the headline is chosen
        feasible.sort(key=lambda c: request_rank(c, mix.rate))
        seen = f">= {slo.min_user_tok_s:g} tok/s per user as users see it, prefill interleaved"
        out = [f"search (SLO: {seen}, TTFT <= {slo.max_ttft_s:g} s), {ranking_rule(mix.rate)}:"]
    feasible = feasible[:5]
    out.append(_table(HEADERS, [_candidate_row(c, plan) for c in feasible]) if feasible else "  no candidate meets the SLO")
    out.append("")
    out.append("best per instance size (what binds; sizes where nothing fits are absent):")
    out.append(_table(HEADERS, [_candidate_row(c, plan) for c in plan.search.best_per_size().values()]))
    if plan.request.system.price_is_placeholder:
        out.append("* at a placeholder price: scale by your $/accelerator-hour")
    return out


def _front_table(plan: Plan) -> list[str]:
    rows = front(plan.front)
    n_ok = sum(r.feasible for r in plan.front)
    out = [f"Pareto front of the whole search under the SLO ({len(plan.front):,} points, {n_ok:,} feasible, {len(rows)} on the front):"]
    if not rows:
        return [*out, "  empty: no point meets the SLO"]
    body = [[r.candidate.describe(), f"{r.candidate.concurrency:,}", f"{r.per_user_tok_s:.1f}", f"{r.per_accelerator_tok_s:,.0f}",
             f"{r.candidate.metrics.usd_per_m_output:.3f}"] for r in rows]  # fmt: skip
    return [*out, _table(["layout", "sequences", "tok/s/user", "tok/s/acc", "$/1M out"], body)]


def _traffic_table(plan: Plan) -> list[str]:
    t = plan.traffic
    if t is None:
        return []
    n = max(t.tokens, 1e-9)
    vendor = plan.request.system.accelerator.vendor
    fabric = vendor.scale_up_fabric if vendor is not None else "scale-up fabric"
    rows = [
        ["weights (HBM read)", _size(t.weights), _size(t.weights / n)],
        ["KV/state (HBM read + KDA write)", _size(t.kv_state), _size(t.kv_state / n)],
        [f"expert all-to-all, scale-up ({fabric})", _size(t.a2a_scale_up), _size(t.a2a_scale_up / n)],
        ["expert all-to-all, scale-out (NIC)", _size(t.a2a_scale_out), _size(t.a2a_scale_out / n)],
        ["TP all-reduce, scale-up / scale-out", f"{_size(t.allreduce_scale_up)} / {_size(t.allreduce_scale_out)}", ""],
        ["MoonEP weight prefetch", _size(t.prefetch), ""],
    ]
    head = f"bytes per decode step on the busiest rank ({t.tokens:,.0f} tokens; fabric bytes are sent + received):"
    return [head, _table(["flow", "per step", "per token"], rows)]


def _user_speed(c: Candidate, plan: Plan) -> str:
    """The per-user speed the SLO was checked on, and where it comes from."""
    if plan.request.requests is None:
        return f"{c.user_tok_s:.1f} tok/s per user (decode steps: no workload given, so no prefill load is implied; --input/--output adds it)"
    return f"{c.user_tok_s:.1f} tok/s per user with the workload's prefill interleaved ({c.metrics.per_user_tok_s:.1f} on decode steps alone)"


def _cap_note(plan: Plan) -> str:
    c = plan.choice
    cap = c.batch_cap if c else ""
    rate = plan.request.requests.rate if plan.request.requests is not None else None
    if c is not None and cap == "replicas" and rate is not None and c.busy_s is not None:
        n = replicas_for(rate, c.busy_s)
        fewer = (
            f"1 replica carry {rate:g} requests/s instead of 2, and at that load its"
            if n == 2
            else f"{n - 1} replicas carry {rate:g} requests/s instead of {n}, and at that share their"
        )
        return f"; batch stops at the fleet's step: one more sequence per group lets {fewer} users miss the per-user SLO (the batch's own speed would meet it)"
    return {"memory": "; batch capped by HBM capacity", "SLO": "; batch capped by the SLO (one more sequence per group misses it)"}.get(cap, "")


def render_text(plan: Plan) -> str:
    out = _header(plan)
    out.append("")
    m = plan.metrics
    if m is None or plan.layout is None:
        out.append(f"no plan: {plan.problem}")
        if plan.memory is not None and plan.layout is not None:
            out.append(f"closest layout: {plan.layout.describe()}")
            out.append(_memory_table(plan))
        if plan.disagg is not None:  # a disaggregated plan can exist where no aggregated one does
            out.append("")
            out.extend(comparison_lines(plan.disagg, _price_note(plan)))
        out.append("")
        out.extend(_search_tables(plan))
        return "\n".join(out)
    out.append(
        f"plan: {plan.layout.describe()}; {plan.workload.concurrency:,} sequences "
        f"({m.memory.seqs_per_group} per DP group); max concurrency at this context {plan.max_concurrency:,}"
    )
    if plan.queue is not None:
        stats, met = plan.queue
        where = f"at {met.percentile} of requests" if met.percentile else "not even at the median"
        out.append(f"SLO under queueing ({stats.spec.arrivals.value} arrivals at the planned rate, simulated): met {where}")
    if plan.support is not None:
        out.append(f"who can run it: {plan.support.describe()}")
    out.append(_memory_table(plan))
    out.append(f"fits: {m.memory.fits}")
    out.append("")
    rows = [[c.name, _size(c.bytes), f"{c.flops / 1e12:,.1f} TF", f"{c.time_s * 1e3:.2f} ms", c.bound] for c in m.decode.components]
    rows.append(["communication (exposed)", "", "", f"{m.decode.exposed_comm_s * 1e3:.2f} ms", f"of {m.decode.comm_s * 1e3:.2f} ms"])
    out.append(_table(["decode step, busiest rank", "HBM bytes", "FLOPs", "time", "bound"], rows))
    assert plan.choice is not None
    out.append(
        f"decode step {m.decode.total_s * 1e3:.2f} ms (rank imbalance x{m.decode.imbalance:.2f}); {_user_speed(plan.choice, plan)}; "
        f"{m.throughput_tok_s:,.0f} tok/s per instance while decoding ({m.per_accelerator_tok_s:,.0f} per accelerator)"
    )
    if m.spec is not None and plan.request.spec is not None:
        out.append(
            f"  {plan.request.spec.describe()}: iteration {m.spec.total_s * 1e3:.2f} ms = verify {m.spec.verify_s * 1e3:.2f} ms "
            f"+ drafts {m.spec.draft_s * 1e3:.2f} ms, {m.spec.per_token_s * 1e3:.2f} ms per token; KDA per-position states "
            f"{_size(m.spec.snapshot_bytes)} per rank for verification (in the memory table's KDA state)"
        )
    out.append(f"TTFT {m.ttft_s:.2f} s for a {plan.workload.prompt_tokens:,}-token prompt; prefill {m.prefill_tok_s:,.0f} tok/s")
    lp = plan.choice.long_prefill if plan.choice else None
    if lp is not None:
        out.append(
            f"  prefill {lp.describe()}: TTFT {lp.plain_ttft_s:.2f} s -> {lp.ttft_s:.2f} s ({lp.chunks_per_rank} chunks per rank, "
            f"{lp.stage_s * 1e3:.1f} ms per stage, bubble {lp.bubble:.1%}, ring {lp.ring_s:.2f} s of which {lp.ring_exposed_s:.2f} s exposed, "
            f"KDA recurrence +{lp.kda_extra_s:.2f} s, shard gather {lp.gather_s:.2f} s, decode +{lp.decode_hop_s * 1e6:.0f} us per step)"
        )
    out.append(
        f"energy: decode {m.tokens_per_joule:.2f} tok/J ({m.decode_power_w:,.0f} W per accelerator), prefill "
        f"{m.prefill_tokens_per_joule:.2f} tok/J ({m.prefill_power_w:,.0f} W)"
    )
    out.append(
        f"${m.usd_per_m_output:.3f} per 1M output tokens, ${m.usd_per_m_input:.3f} per 1M input tokens{_price_note(plan)}; "
        f"binding: {m.binding} (step dominated by {m.decode.dominant})" + _cap_note(plan)
    )
    if plan.demand is not None:
        out.extend(describe_demand(plan.demand, _price_note(plan)))
    if plan.choice is not None and plan.headline_slo_rps is not None and plan.demand is not None and plan.demand.accelerators is not None:
        price = plan.request.system.price_per_hour
        out.extend(describe_fleet(plan.fleet, plan.choice, plan.headline_slo_rps, plan.demand.accelerators, price, _price_note(plan)))
    if plan.queue is not None and plan.demand is not None and plan.demand.replicas is not None:
        out.extend(describe_queue(*plan.queue, plan.demand.replicas))
    if plan.agent is not None and plan.layout is not None:
        out.extend(describe_cost(plan.agent, plan.layout.num_accelerators, _price_note(plan)))
    if plan.disagg is not None:
        out.append("")
        out.extend(comparison_lines(plan.disagg, _price_note(plan)))
    out.append("")
    out.extend(_traffic_table(plan))
    out.append("")
    out.extend(_search_tables(plan))
    out.append("")
    out.extend(_front_table(plan))
    out.append("")
    ctx = plan.workload.context
    out.append(f"offload tiers for a parked {ctx:,}-token prefix (reload vs recompute):")
    out.append(
        _table(
            ["tier", "GB/s", "capacity", "prefixes", "reload s", "recompute s", "pays off"],
            [
                [r.tier, f"{r.bandwidth / 1e9:,.0f}", _size(r.capacity), f"{r.sequences:,}", f"{r.reload_s:.4f}", f"{r.recompute_s:.3f}", str(r.pays_off)]
                for r in plan.tiers
            ],
        )
    )
    be = ", ".join(f"{k} from {v:,} tokens" if v else f"{k} never" for k, v in plan.break_even.items())
    out.append(f"reload beats recompute: {be}")
    return "\n".join(out)
