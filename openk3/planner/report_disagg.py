"""Render a disaggregation comparison (`disagg.Comparison`) as text lines and as a JSON-ready dict."""

from __future__ import annotations

from typing import Any

from openk3.planner.disagg import Aggregated, Comparison, Disaggregated


def _dis_json(d: Disaggregated) -> dict[str, Any]:
    lp = d.prefill.long_prefill
    return {
        "describe": d.describe(),
        "x": d.x,
        "y": d.y,
        "accelerators": d.accelerators,
        "prefill_layout": d.prefill.layout.describe(),
        "prefill_long_prefill": None if lp is None else {"pp": lp.pp, "cp": lp.cp, "kda": lp.kda.value, "ttft_s": lp.ttft_s},
        "prefill_ttft_s": d.prefill.ttft_s,
        "prefill_busy_s_per_request": d.prefill.busy_s,
        "decode_layout": d.decode.layout.describe(),
        "decode_seqs_per_group": d.decode.seqs_per_group,
        "decode_per_user_tok_s": d.decode.metrics.per_user_tok_s,
        "decode_tok_s_per_accelerator": d.decode.metrics.per_accelerator_tok_s,
        "transfer": {"bytes": d.transfer.bytes, "lanes": d.transfer.lanes, "link": d.transfer.link, "seconds": d.transfer.seconds},
        "ttft_s": d.ttft_s,
        "rate": d.rate,
        "usd_per_request": d.usd_per_request,
    }


def _agg_json(a: Aggregated) -> dict[str, Any]:
    d, c = a.demand, a.candidate
    return {
        "layout": c.describe(),
        "seqs_per_group": c.seqs_per_group,
        "replicas": d.replicas,
        "accelerators": a.accelerators,
        "decode_step_user_tok_s": c.metrics.per_user_tok_s,
        "user_tok_s_with_prefill": d.user_tok_s,
        "decode_stretch": d.decode_stretch,
        "prefill_share": d.prefill_share,
        "ttft_s": c.metrics.ttft_s,
        "usd_per_request": a.usd_per_request,
    }


def comparison_json(c: Comparison) -> dict[str, Any]:
    return {
        "rate": c.rate,
        "winner": c.winner,
        "why": c.why,
        "disaggregated": None if c.disaggregated is None else _dis_json(c.disaggregated),
        "aggregated": None if c.aggregated is None else _agg_json(c.aggregated),
    }


def comparison_lines(c: Comparison, price_note: str = "") -> list[str]:
    rate = f"{c.rate:g} requests/s" if c.rate is not None else "no rate"
    out = [f"prefill/decode disaggregation vs aggregated serving, same SLO, sized for {rate}:"]
    d, a = c.disaggregated, c.aggregated
    if d is not None:
        out.append(f"  disaggregated {d.describe()}")
        out.append(
            f"    {d.accelerators:,} accelerators; TTFT {d.ttft_s:.2f} s (prefill {d.prefill.ttft_s:.2f} s + transfer "
            f"{d.transfer.bytes / 1e9:,.2f} GB over {d.transfer.link} x{d.transfer.lanes} in {d.transfer.seconds * 1e3:,.1f} ms); "
            f"{d.decode.metrics.per_user_tok_s:.1f} tok/s/user; ${d.usd_per_request:.5f} per request{price_note}"
        )
    else:
        out.append("  disaggregated: no pair meets the SLO")
    if a is not None:
        ad = a.demand
        out.append(f"  aggregated {ad.replicas or 1} x [{a.candidate.describe()}, {a.candidate.seqs_per_group} seq/group]")
        out.append(
            f"    {a.accelerators:,} accelerators; TTFT {a.candidate.metrics.ttft_s:.2f} s; {ad.user_tok_s:.1f} tok/s/user with prefill "
            f"interleaved ({a.candidate.metrics.per_user_tok_s:.1f} on decode steps alone); ${a.usd_per_request:.5f} per request{price_note}"
        )
    else:
        out.append("  aggregated: no layout meets the SLO with prefill interleaved")
    out.append(f"  winner: {c.winner}. {c.why}")
    return out
