"""`--plot FILE`: the plan as a chart (matplotlib, the optional `plot` extra; PNG, SVG or PDF by the file's suffix).

Left: the headline's memory per accelerator against usable HBM. Middle: every point of the search, tokens/s per
accelerator against tokens/s per user, infeasible ones grey, feasible ones green, the SLO-constrained Pareto front as a
line, the SLO as a vertical line and the headline circled. Right: the decode step's bytes on the busiest rank by flow
(weights, KV/state, all-to-all over scale-up and scale-out), the seed's three flows on one scale.
"""

from __future__ import annotations

from pathlib import Path

from openk3.planner.pareto import front
from openk3.planner.plan import Plan


class PlotUnavailable(RuntimeError):
    pass


def write_plot(plan: Plan, path: str | Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailable("--plot needs matplotlib, an optional extra: pip install 'openk3[plot]'") from exc
    if plan.memory is None or plan.layout is None:
        raise PlotUnavailable(f"nothing to plot: {plan.problem}")
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(18, 5.5))
    mem = plan.memory.as_dict()
    bottom = 0.0
    for k in (k for k in mem if k not in ("total", "capacity")):
        ax1.bar([plan.layout.describe()], [mem[k] / 1e9], bottom=bottom, label=k)
        bottom += mem[k] / 1e9
    ax1.axhline(mem["capacity"] / 1e9, color="k", linestyle="--", label="usable HBM")
    ax1.set_ylabel("GB per accelerator")
    ax1.legend(fontsize=8)
    ax1.set_title("memory breakdown")
    ax1.tick_params(axis="x", labelsize=7)

    rows = plan.front
    for feasible, colour, label in ((False, "tab:gray", "misses the SLO"), (True, "tab:green", "meets the SLO")):
        pts = [r for r in rows if r.feasible == feasible]
        ax2.scatter([r.per_user_tok_s for r in pts], [r.per_accelerator_tok_s for r in pts], s=8, color=colour, label=label)
    edge = front(rows)
    if edge:
        ax2.plot([r.per_user_tok_s for r in edge], [r.per_accelerator_tok_s for r in edge], color="tab:red", marker="o", ms=3, label="Pareto front")
    slo = plan.request.slo
    if slo.min_user_tok_s > 0:
        ax2.axvline(slo.min_user_tok_s, color="k", linestyle=":", label=f"SLO {slo.min_user_tok_s:g} tok/s/user")
    if plan.metrics is not None:
        ax2.scatter([plan.metrics.per_user_tok_s], [plan.metrics.per_accelerator_tok_s], s=90, facecolors="none", edgecolors="k", label="plan")
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("tokens/s per user")
    ax2.set_ylabel("tokens/s per accelerator")
    ax2.set_title("search: throughput vs per-user speed")
    ax2.legend(fontsize=8)

    t = plan.traffic
    if t is not None:
        flows = {
            "weights (HBM)": t.weights,
            "KV/state (HBM)": t.kv_state,
            "a2a scale-up": t.a2a_scale_up,
            "a2a scale-out": t.a2a_scale_out,
            "TP all-reduce": t.allreduce_scale_up + t.allreduce_scale_out,
        }
        # log scale: the all-to-all is often two orders below the HBM flows; a zero flow is named, not drawn
        names = [k if v > 0 else f"{k} (0)" for k, v in flows.items()]
        ax3.barh(names, [v / 1e9 if v > 0 else float("nan") for v in flows.values()], color=["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"])
        ax3.set_xscale("log")
        ax3.set_xlabel("GB per decode step, busiest rank (log)")
        ax3.set_title("bytes by flow")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
