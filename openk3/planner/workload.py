"""Requests, not sequences: input/output lengths (one pair or a distribution) and a request rate -> replicas,
accelerators, $ per request, and the prefill and decode time of each request.

An instance (replica) serves requests by time-sharing prefill and decode (aggregated serving, chunked prefill). Per
request it is busy `input / prefill tok/s + output / decode tok/s` replica-seconds, at the prefill throughput of that
prompt length and the decode throughput of the plan's batch. So one replica sustains `1 / mean busy seconds` requests
per second, `rate` needs `ceil(rate / that)` replicas, and a request costs its busy seconds x the replica's $/s (at full
utilisation; the fleet figure divides the provisioned fleet's $/s by the rate).

The search plans one decode context and one prompt: the context is the time-average cache of a decoding sequence,
weighted by output length (a request holds its slot for `output` steps at `input + (output - 1) / 2` cached tokens
on average), and the TTFT SLO is checked at the 90th-percentile prompt; candidates are ranked by $ per request
(with a rate: the fleet's, `plan.request_rank`). Times
per request are then computed for every pair of the distribution on the chosen layout: prefill = its prompt's chunks
run alone (service time, no queueing); decode = output tokens x the decode step, stretched by the share of the
replica's time that prefill takes at the served rate (prefill steps interleave with decode steps). That stretched speed
is what a user sees, and it is what the search checks the per-user SLO on, in the headline and in every row (issue 37
item 2); only a disaggregated decode pool (`--disagg`) is judged on its own steps.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from openk3.checks import check_int, check_number
from openk3.planner.perf import Metrics, Scenario, prefill_batch_step, prefill_step
from openk3.planner.pp_cp import LongPrefill, long_prefill


@dataclass(frozen=True)
class RequestMix:
    pairs: tuple[tuple[int, int], ...]  # (input tokens, output tokens) per request, equally likely
    rate: float | None = None  # requests per second; None: size one replica, report its capacity

    def __post_init__(self) -> None:
        if not self.pairs:
            raise ValueError("RequestMix.pairs=() is invalid: expected at least one [input, output] pair")
        for i, (inp, out) in enumerate(self.pairs):
            check_int("RequestMix", f"pairs[{i}][0] (input tokens)", inp, low=1)
            check_int("RequestMix", f"pairs[{i}][1] (output tokens)", out, low=1)
        if self.rate is not None:
            check_number("RequestMix", "rate", self.rate, low=0)
            if not self.rate > 0:
                raise ValueError(f"RequestMix.rate={self.rate!r} is invalid: expected requests per second > 0")

    @classmethod
    def from_file(cls, path: str | Path, rate: float | None = None) -> RequestMix:
        """A JSON list of [input, output] token pairs, one per request."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--requests {path}: cannot read a JSON list of [input, output] pairs ({exc})") from None
        if not isinstance(data, list) or not all(isinstance(p, list) and len(p) == 2 for p in data):
            raise ValueError(f"--requests {path}: expected a JSON list of [input, output] pairs, e.g. [[2048, 512], [8000, 300]]")
        return cls(tuple((p[0], p[1]) for p in data), rate)

    @property
    def mean_input(self) -> float:
        return sum(i for i, _ in self.pairs) / len(self.pairs)

    @property
    def mean_output(self) -> float:
        return sum(o for _, o in self.pairs) / len(self.pairs)

    @property
    def decode_context(self) -> int:
        """Time-average cached tokens of a decoding sequence (output-weighted), rounded up."""
        held = sum(o * (i + (o - 1) / 2) for i, o in self.pairs)
        return max(1, math.ceil(held / sum(o for _, o in self.pairs)))

    @property
    def ttft_prompt(self) -> int:
        """The 90th-percentile prompt (nearest rank): the prompt the search checks the TTFT SLO at."""
        inputs = sorted(i for i, _ in self.pairs)
        return inputs[max(0, math.ceil(0.9 * len(inputs)) - 1)]


def prefill_times(sc: Scenario, prompt: int, split: LongPrefill | None = None) -> tuple[float, float]:
    """(replica busy seconds to prefill one `prompt`-token request at packed throughput, its TTFT run alone) on `sc`'s
    layout; with `split`, the TTFT of that PP/CP split of the prompt (the busy seconds are the same work)."""
    s = sc.with_(workload=replace(sc.workload, prompt=prompt))
    batch = prefill_batch_step(s)
    busy = prompt / (batch.tokens_per_group * sc.layout.dp / batch.total_s)
    if split is not None:
        return busy, long_prefill(s, split.pp, split.cp, split.kda).ttft_s
    chunk = min(s.workload.prefill_chunk, prompt)
    return busy, -(-prompt // chunk) * prefill_step(s).total_s


def mean_prefill_busy(sc: Scenario, mix: RequestMix) -> float:
    """Replica busy seconds of prefill per request, averaged over the mix."""
    times = {p: prefill_times(sc, p)[0] for p in {i for i, _ in mix.pairs}}
    return sum(times[i] for i, _ in mix.pairs) / len(mix.pairs)


def replicas_for(rate: float, busy_s: float) -> int:
    """Replicas `rate` requests/s need when each request keeps a replica busy `busy_s` seconds."""
    return max(1, math.ceil(rate * busy_s - 1e-9))


def decode_stretch(prefill_busy_s: float, decode_busy_s: float, rate: float | None) -> float:
    """Wall time per decode step / the step itself, when a replica also prefills arriving requests: with `prefill_busy_s`
    and `decode_busy_s` replica-seconds per request, one replica sustains 1 / (their sum) requests/s; `rate` (None: the
    replica runs at that capacity) is spread over ceil(rate / capacity) replicas, and prefill takes `served x prefill
    busy` of each replica's time, during which its decode steps wait."""
    capacity = 1 / (prefill_busy_s + decode_busy_s)
    served = capacity if rate is None else rate / replicas_for(rate, prefill_busy_s + decode_busy_s)
    return 1 / (1 - served * prefill_busy_s)


@dataclass(frozen=True)
class Spread:
    p50: float
    p90: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        v = sorted(values)
        rank = lambda q: v[max(0, math.ceil(q * len(v)) - 1)]  # noqa: E731
        return cls(rank(0.5), rank(0.9), v[-1])


@dataclass(frozen=True)
class Demand:
    mix: RequestMix
    replica_accelerators: int
    busy_s_per_request: float  # replica-seconds per request, prefill and decode
    prefill_share: float  # of the busy time
    replica_rps: float  # requests per second one replica sustains
    replicas: int | None  # None without a rate
    utilisation: float  # of the provisioned replicas (1.0 without a rate)
    usd_per_request: float  # at full utilisation
    usd_per_request_fleet: float | None  # provisioned fleet $/s / rate
    usd_per_m_tokens: float  # input + output tokens, at full utilisation
    prefill_s: Spread  # TTFT service time per request
    decode_s: Spread
    e2e_s: Spread
    decode_stretch: float  # wall time per decode step / the step itself, at the served rate
    user_tok_s: float  # per-user decode speed with prefill interleaved

    @property
    def accelerators(self) -> int | None:
        return None if self.replicas is None else self.replicas * self.replica_accelerators


def demand(sc: Scenario, metrics: Metrics, mix: RequestMix, split: LongPrefill | None = None) -> Demand:
    """Size the fleet for `mix` on the layout of `sc` (whose decode batch gave `metrics`); `split` is the PP/CP the
    candidate prefills its prompts with, if any."""
    times = {prompt: prefill_times(sc, prompt, split) for prompt in sorted({i for i, _ in mix.pairs})}
    prefill_busy = {p: t[0] for p, t in times.items()}
    ttft = {p: t[1] for p, t in times.items()}
    pre = sum(prefill_busy[i] for i, _ in mix.pairs) / len(mix.pairs)
    dec = mix.mean_output / metrics.throughput_tok_s
    busy = pre + dec
    replica_rps = 1 / busy
    replicas = None if mix.rate is None else replicas_for(mix.rate, busy)
    served = replica_rps if mix.rate is None or replicas is None else mix.rate / replicas
    stretch = decode_stretch(pre, dec, mix.rate)  # decode steps share the replica with the prefill of arriving requests
    usd_per_s = sc.system.price_per_hour * sc.layout.num_accelerators / 3600
    step = 1 / metrics.per_user_tok_s  # the decode step, with any PP hops
    decode = [o * step * stretch for _, o in mix.pairs]
    prefill = [ttft[i] for i, _ in mix.pairs]
    return Demand(
        mix=mix,
        replica_accelerators=sc.layout.num_accelerators,
        busy_s_per_request=busy,
        prefill_share=pre / busy,
        replica_rps=replica_rps,
        replicas=replicas,
        utilisation=served / replica_rps,
        usd_per_request=usd_per_s * busy,
        usd_per_request_fleet=None if mix.rate is None or replicas is None else usd_per_s * replicas / mix.rate,
        usd_per_m_tokens=usd_per_s * busy / (mix.mean_input + mix.mean_output) * 1e6,
        prefill_s=Spread.of(prefill),
        decode_s=Spread.of(decode),
        e2e_s=Spread.of([p + d for p, d in zip(prefill, decode, strict=True)]),
        decode_stretch=stretch,
        user_tok_s=1 / (step * stretch),
    )


def describe(d: Demand, price_note: str = "") -> list[str]:
    mix = d.mix
    n = len(mix.pairs)
    shape = f"{n:,} requests, mean {mix.mean_input:,.0f} in / {mix.mean_output:,.0f} out" if n > 1 else f"{mix.pairs[0][0]:,} in / {mix.pairs[0][1]:,} out"
    lines = [
        f"workload: {shape}; planned at decode context {mix.decode_context:,} and TTFT prompt {mix.ttft_prompt:,}",
        f"per replica ({d.replica_accelerators} acc): {d.replica_rps:,.3f} requests/s ({d.busy_s_per_request * 1e3:,.1f} ms busy per request, "
        f"{d.prefill_share:.0%} of it prefill)",
    ]
    if mix.rate is not None and d.replicas is not None:
        plural = "" if d.replicas == 1 else "s"
        lines.append(f"demand {mix.rate:g} requests/s -> {d.replicas:,} replica{plural} = {d.accelerators:,} accelerators ({d.utilisation:.0%} utilised)")
    fleet = f"; ${d.usd_per_request_fleet:.5f} per request at the provisioned fleet" if d.usd_per_request_fleet is not None else ""
    lines.append(f"${d.usd_per_request:.5f} per request, ${d.usd_per_m_tokens:.3f} per 1M tokens (in + out) at full utilisation{fleet}{price_note}")
    lines.append(
        f"  decode steps share the replica with prefill: {1 / d.decode_stretch:.0%} of its time is decode, so each user sees "
        f"{d.user_tok_s:.1f} tok/s (what the per-user SLO is checked on; decode steps alone would give {d.user_tok_s * d.decode_stretch:.1f})"
    )
    for name, s in (("prefill (TTFT service)", d.prefill_s), ("decode", d.decode_s), ("end to end", d.e2e_s)):
        lines.append(f"  {name} per request: p50 {s.p50:.3f} s, p90 {s.p90:.3f} s, max {s.max:.3f} s")
    return lines
