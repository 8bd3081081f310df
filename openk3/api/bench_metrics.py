"""The arithmetic of `openk3 bench serve`: per-request results -> the summary, the JSON arrays and the printed table (vLLM's).

A statistic over no values is None (printed N/A), never 0: a run where every request failed must not read as a fast one.
Peak output throughput is vLLM's: the run is cut into 1-second windows from the first send, each chunk's tokens are counted in
the window it arrived in, and the fullest window wins; a chunk carries output_tokens / chunks tokens (1 with one token a chunk).
Peak concurrent requests is exact (peak_concurrency), so it never reads above --max-concurrency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

SLO_KEYS = ("ttft", "tpot", "e2el")
METRICS = ("ttft", "tpot", "itl", "e2el")
TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


@dataclass
class RequestResult:
    success: bool = False
    prompt_tokens: int = 0  # the server's usage, else what the client knows (token-id prompts)
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    reply: str = ""
    start: float = 0.0  # the client's clock at send
    end: float | None = None  # the client's clock when the request was done with, failed or not (None: never sent)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS:
            raise ValueError(f"--goodput {item!r}: the key must be one of {', '.join(SLO_KEYS)}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: the value must be a number of milliseconds") from None
    return slos


def parse_percentile_metrics(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in METRICS]
    if bad or not names:
        raise ValueError(f"--percentile-metrics {text!r}: expected a comma-separated list of {', '.join(METRICS)}")
    return names


def parse_metric_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        values = []
    if not values or not all(0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles {text!r}: expected comma-separated numbers in [0, 100], e.g. 50,90,99")
    return values


def percentile_name(p: float) -> str:
    return str(int(p)) if p == int(p) else str(p)


def tpot(r: RequestResult) -> float | None:
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def _stats(name: str, values_s: list[float], percentiles: list[float]) -> dict[str, float | None]:
    import numpy as np

    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"] + [f"p{percentile_name(p)}_{name}_ms" for p in percentiles]
    if not values_s:
        return dict.fromkeys(keys)
    v = np.asarray(values_s, dtype=np.float64) * 1000
    values = [v.mean(), np.median(v), v.std()] + [np.percentile(v, p) for p in percentiles]
    return {k: float(x) for k, x in zip(keys, values, strict=True)}


def token_times(r: RequestResult) -> list[float]:
    """When each chunk with tokens arrived, on the client's clock."""
    if not r.success or r.output_tokens == 0:
        return []
    times = [r.start + r.ttft]
    for gap in r.itl:
        times.append(times[-1] + gap)
    return times


def peak_concurrency(results: list[RequestResult]) -> int | None:
    """The most requests in flight at one instant: a sweep over each request's [send, done) interval, a request that ends
    at the instant another starts not overlapping it. Exact, so never above --max-concurrency (vLLM counts the requests
    that touch each 1-second window, which can exceed the cap whenever one request ends and the next starts within a
    second). Failed requests count too: they held their place while they were in flight."""
    events = sorted((t, step) for r in results if r.end is not None for t, step in ((r.start, 1), (r.end, -1)))  # -1 sorts first at a tie
    if not events:
        return None
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def peaks(results: list[RequestResult]) -> tuple[float | None, int | None]:
    """(most output tokens in one 1-second window, over the successful requests; most requests in flight at once)."""
    ok = [r for r in results if r.success]
    if not ok:
        return None, peak_concurrency(results)
    t0 = min(r.start for r in ok)
    windows = math.ceil(max(r.start + r.latency for r in ok) - t0) + 1
    tokens = [0.0] * windows
    for r in ok:
        times = token_times(r)
        for t in times:
            tokens[min(int(t - t0), windows - 1)] += r.output_tokens / len(times)
    return max(tokens), peak_concurrency(results)


def per_request(results: list[RequestResult]) -> dict[str, list]:
    """vLLM's per-request arrays (seconds; a failed request has ttft 0, no itls, output_len 0 and its error), plus send times."""
    t0 = min((r.start for r in results), default=0.0)
    return {
        "input_lens": [r.prompt_tokens for r in results],
        "output_lens": [r.output_tokens if r.success else 0 for r in results],
        "ttfts": [r.ttft if r.success else 0.0 for r in results],
        "itls": [list(r.itl) if r.success else [] for r in results],
        "e2els": [r.latency if r.success else 0.0 for r in results],
        "start_times": [r.start - t0 for r in results],
        "generated_texts": [r.reply for r in results],
        "errors": [r.error for r in results],
    }


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float], percentiles: list[float] | None = None) -> dict[str, Any]:
    """The summary; every metric gets mean, median, std and the given percentiles (default 99), whichever the table prints."""
    percentiles = [99.0] if percentiles is None else percentiles
    ok = [r for r in results if r.success]
    tpots = [t for t in (tpot(r) for r in ok) if t is not None]
    total_in, total_out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)

    def per_s(x: float) -> float | None:
        return x / duration if ok and duration > 0 else None

    good = 0
    for r in ok:
        measured = {"ttft": r.ttft * 1000, "tpot": (tpot(r) or 0.0) * 1000, "e2el": r.latency * 1000}
        good += all(measured[k] <= v for k, v in slos.items())
    peak_tokens, peak_requests = peaks(results)
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
        "request_goodput": per_s(good) if slos else None,
        "goodput_slos_ms": slos,
        "metric_percentiles": percentiles,
    }
    values = {"ttft": [r.ttft for r in ok], "tpot": tpots, "itl": [x for r in ok for x in r.itl], "e2el": [r.latency for r in ok]}
    for name in METRICS:
        out.update(_stats(name, values[name], percentiles))
    out["error_kinds"] = sorted({r.error for r in results if r.error})[:10]
    out.update(per_request(results))
    return out


def _row(label: str, value: Any) -> str:
    text = "N/A" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label + ':':<40} {text}"


def format_table(result: dict, metrics: list[str]) -> str:
    """vLLM's result block: the totals, then mean, median and each percentile of every metric asked for."""
    rows = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    rows += [_row("Successful requests", result["completed"]), _row("Failed requests", result["failed"])]
    if result.get("max_concurrency") is not None:
        rows.append(_row("Maximum request concurrency", result["max_concurrency"]))
    if result.get("request_rate") is not None:
        rows.append(_row("Request rate configured (RPS)", result["request_rate"]))
    rows += [
        _row("Benchmark duration (s)", result["duration"]),
        _row("Total input tokens", result["total_input_tokens"]),
        _row("Total generated tokens", result["total_output_tokens"]),
        _row("Request throughput (req/s)", result["request_throughput"]),
    ]
    if result["goodput_slos_ms"]:
        rows.append(_row("Request goodput (req/s)", result["request_goodput"]))
    rows += [
        _row("Output token throughput (tok/s)", result["output_throughput"]),
        _row("Peak output token throughput (tok/s)", result["max_output_tokens_per_s"]),
        _row("Peak concurrent requests", result["max_concurrent_requests"]),
        _row("Total token throughput (tok/s)", result["total_token_throughput"]),
    ]
    if "ideal_prefix_hit_rate" in result:
        rows.append(_row("Ideal prefix hit rate", result["ideal_prefix_hit_rate"]))
    for name in metrics:
        rows.append("{s:{c}^50}".format(s=TITLES[name], c="-"))
        label = name.upper()
        rows += [_row(f"Mean {label} (ms)", result[f"mean_{name}_ms"]), _row(f"Median {label} (ms)", result[f"median_{name}_ms"])]
        for p in result["metric_percentiles"]:
            rows.append(_row(f"P{percentile_name(p)} {label} (ms)", result[f"p{percentile_name(p)}_{name}_ms"]))
    rows.append("=" * 50)
    return "\n".join(rows)
