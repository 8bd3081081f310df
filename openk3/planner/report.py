"""Render a `Plan`: readable text tables, a JSON document, and (optionally, with matplotlib) PNG charts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openk3.planner.plan import Plan
from openk3.planner.search import Candidate


def _gb(x: float) -> str:
    return f"{x / 1e9:,.1f} GB"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _candidate_row(c: Candidate) -> list[str]:
    m = c.metrics
    return [
        c.layout.describe(),
        str(c.seqs_per_group),
        f"{m.per_user_tok_s:.1f}",
        f"{m.ttft_s:.2f}",
        f"{m.per_accelerator_tok_s:,.0f}",
        f"{m.usd_per_m_output:.3f}",
        m.binding,
        m.decode.dominant,
        c.miss or "ok",
    ]


def render_text(plan: Plan) -> str:
    req, m, w = plan.request, plan.metrics, plan.weights
    acc = req.system.accelerator
    out: list[str] = []
    pc = req.config.param_count()
    out.append(
        f"openk3 plan: {req.config.name} on {req.system.name} ({acc.name}, {_gb(acc.usable_hbm)} usable HBM, "
        f"{acc.hbm_bw / 1e12:.2f} TB/s, ${req.system.price_per_hour:.2f}/acc-h)"
    )
    out.append(
        f"parameters {pc.total / 1e12:.3f}T total, {pc.active / 1e9:.1f}B active; checkpoint {_gb(w.checkpoint_bytes)} "
        f"= routed experts {_gb(w.routed_bytes)} ({req.quant.expert_bits:g} bit) + rest {_gb(w.trunk_bytes)} "
        f"({req.quant.trunk_bits:g} bit)"
    )
    ctx = plan.workload.context
    out.append(
        f"cache per sequence at {ctx:,} tokens: MLA {plan.mla_bytes_per_token:,} B/token -> {_gb(ctx * plan.mla_bytes_per_token)}"
        f", KDA state + conv {_gb(plan.kda_bytes_per_sequence)}"
    )
    mw, mk = plan.min_for_weights, plan.min_for_workload
    out.append(
        f"minimum accelerators: weights only {mw.num_accelerators if mw else 'n/a'} (fill {req.fill:.0%}); "
        f"weights + {plan.workload.concurrency:,} sequences: {mk.num_accelerators if mk else '> search limit'}"
    )
    out.append("")
    out.append(
        f"layout: {plan.layout.describe()}; {plan.workload.concurrency:,} sequences "
        f"({m.memory.seqs_per_group} per DP group); max concurrency at this context {plan.max_concurrency:,}"
    )
    mem = m.memory.as_dict()
    out.append(_table(["memory per accelerator", "bytes"], [[k, _gb(v)] for k, v in mem.items()]))
    out.append(f"fits: {m.memory.fits}")
    out.append("")
    rows = [[c.name, _gb(c.bytes), f"{c.flops / 1e12:,.1f} TF", f"{c.time_s * 1e3:.2f} ms", c.bound] for c in m.decode.components]
    rows.append(["communication (exposed)", "", "", f"{m.decode.exposed_comm_s * 1e3:.2f} ms", f"of {m.decode.comm_s * 1e3:.2f} ms"])
    out.append(_table(["decode step, busiest rank", "HBM bytes", "FLOPs", "time", "bound"], rows))
    out.append(
        f"decode step {m.decode.total_s * 1e3:.2f} ms (rank imbalance x{m.decode.imbalance:.2f}); "
        f"{m.per_user_tok_s:.1f} tok/s per user; {m.throughput_tok_s:,.0f} tok/s per instance "
        f"({m.per_accelerator_tok_s:,.0f} per accelerator)"
    )
    out.append(f"TTFT {m.ttft_s:.2f} s for a {plan.workload.prompt_tokens:,}-token prompt; prefill {m.prefill_tok_s:,.0f} tok/s")
    out.append(
        f"{m.tokens_per_joule:.2f} tok/J; ${m.usd_per_m_output:.3f} per 1M output tokens, ${m.usd_per_m_input:.3f} per 1M input"
        f" tokens; binding: {m.binding} (step dominated by {m.decode.dominant})"
    )
    out.append("")
    slo = req.slo
    out.append(f"search (SLO: >= {slo.min_user_tok_s:g} tok/s per user, TTFT <= {slo.max_ttft_s:g} s), cheapest first:")
    headers = ["layout", "seqs/group", "tok/s/user", "TTFT s", "tok/s/acc", "$/1M out", "binding", "step dominated by", "SLO"]
    feasible = plan.search.feasible[:5]
    out.append(_table(headers, [_candidate_row(c) for c in feasible]) if feasible else "  no candidate meets the SLO")
    out.append("")
    out.append("best per instance size (what binds):")
    out.append(_table(headers, [_candidate_row(c) for c in plan.search.best_per_size().values()]))
    out.append("")
    out.append(f"offload tiers for a parked {ctx:,}-token prefix (reload vs recompute):")
    out.append(
        _table(
            ["tier", "GB/s", "capacity", "prefixes", "reload s", "recompute s", "pays off"],
            [
                [r.tier, f"{r.bandwidth / 1e9:,.0f}", _gb(r.capacity), f"{r.sequences:,}", f"{r.reload_s:.4f}", f"{r.recompute_s:.3f}", str(r.pays_off)]
                for r in plan.tiers
            ],
        )
    )
    be = ", ".join(f"{k} from {v:,} tokens" if v else f"{k} never" for k, v in plan.break_even.items())
    out.append(f"reload beats recompute: {be}")
    return "\n".join(out)


def _candidate_json(c: Candidate) -> dict[str, Any]:
    m = c.metrics
    return {
        "layout": c.layout.describe(),
        "accelerators": c.layout.num_accelerators,
        "tp": c.layout.tp,
        "ep": c.layout.ep_size,
        "redundant_experts": c.layout.redundant_experts,
        "balance": c.layout.balance.value,
        "seqs_per_group": c.seqs_per_group,
        "concurrency": c.concurrency,
        "per_user_tok_s": m.per_user_tok_s,
        "ttft_s": m.ttft_s,
        "tok_s_per_accelerator": m.per_accelerator_tok_s,
        "usd_per_m_output": m.usd_per_m_output,
        "binding": m.binding,
        "step_dominated_by": m.decode.dominant,
        "meets_slo": c.meets_slo,
        "miss": c.miss,
    }


def render_json(plan: Plan) -> dict[str, Any]:
    req, m = plan.request, plan.metrics
    pc = req.config.param_count()
    return {
        "model": req.config.name,
        "hardware": req.system.name,
        "context": plan.workload.context,
        "params": {"total": pc.total, "active": pc.active},
        "weights": {"routed_bytes": plan.weights.routed_bytes, "trunk_bytes": plan.weights.trunk_bytes, "checkpoint_bytes": plan.weights.checkpoint_bytes},
        "cache": {"mla_bytes_per_token": plan.mla_bytes_per_token, "kda_bytes_per_sequence": plan.kda_bytes_per_sequence},
        "min_accelerators": {
            "weights": plan.min_for_weights.num_accelerators if plan.min_for_weights else None,
            "workload": plan.min_for_workload.num_accelerators if plan.min_for_workload else None,
        },
        "layout": {
            "describe": plan.layout.describe(),
            "accelerators": plan.layout.num_accelerators,
            "tp": plan.layout.tp,
            "ep": plan.layout.ep_size,
            "balance": plan.layout.balance.value,
        },
        "concurrency": plan.workload.concurrency,
        "max_concurrency": plan.max_concurrency,
        "memory": m.memory.as_dict() | {"fits": m.memory.fits},
        "decode": {
            "step_s": m.decode.total_s,
            "comm_s": m.decode.comm_s,
            "exposed_comm_s": m.decode.exposed_comm_s,
            "imbalance": m.decode.imbalance,
            "components": [{"name": c.name, "bytes": c.bytes, "flops": c.flops, "time_s": c.time_s, "bound": c.bound} for c in m.decode.components],
        },
        "metrics": {
            "throughput_tok_s": m.throughput_tok_s,
            "per_user_tok_s": m.per_user_tok_s,
            "ttft_s": m.ttft_s,
            "prefill_tok_s": m.prefill_tok_s,
            "tokens_per_joule": m.tokens_per_joule,
            "usd_per_m_output": m.usd_per_m_output,
            "usd_per_m_input": m.usd_per_m_input,
            "binding": m.binding,
        },
        "search": {
            "best": _candidate_json(plan.search.best) if plan.search.best else None,
            "per_size": [_candidate_json(c) for c in plan.search.best_per_size().values()],
        },
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


class PlotUnavailable(RuntimeError):
    pass


def write_plot(plan: Plan, path: str | Path) -> Path:
    """Two charts in one PNG: the memory breakdown per accelerator, and instance throughput vs per-user speed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailable("--plot needs matplotlib, an optional extra: pip install 'openk3[plot]'") from exc
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    mem = plan.metrics.memory.as_dict()
    parts = [k for k in mem if k not in ("total", "capacity")]
    bottom = 0.0
    for k in parts:
        ax1.bar([plan.layout.describe()], [mem[k] / 1e9], bottom=bottom, label=k)
        bottom += mem[k] / 1e9
    ax1.axhline(mem["capacity"] / 1e9, color="k", linestyle="--", label="usable HBM")
    ax1.set_ylabel("GB per accelerator")
    ax1.legend(fontsize=8)
    ax1.set_title("memory breakdown")
    for c in plan.search.candidates:
        if c.metrics.memory.fits:
            ax2.scatter(c.metrics.per_user_tok_s, c.metrics.per_accelerator_tok_s, s=8, color="tab:green" if c.meets_slo else "tab:gray")
    ax2.set_xlabel("tokens/s per user")
    ax2.set_ylabel("tokens/s per accelerator")
    ax2.set_title("throughput vs per-user speed (green: meets SLO)")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
