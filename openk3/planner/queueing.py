"""Queueing: TTFT and TPOT percentiles from a small discrete-event simulation of one replica's scheduler (issue 37
item 6; the idea of Vidur, Agrawal et al. 2024: simulate the scheduler's iterations over a cost model of a step).

Requests arrive by a seeded random process -- Poisson (exponential gaps) or bursty (gamma gaps with a squared
coefficient of variation `cv2` > 1, the same mean rate) -- and wait FCFS. The scheduler runs iterations back to back
while there is work, each one (continuous batching with chunked prefill, the engine's rule):
1. admits waiting requests while fewer than `max_batch` are running;
2. gives the iteration up to `chunk` prompt tokens, to the admitted requests still prefilling, oldest first;
3. decodes one token for every running request whose prompt is done.
An iteration costs `step_s(decoding, prefill_tokens)` (the planner's step model: decode step at that batch plus the
chunk's prefill time). A request's first token comes out of the iteration that finishes its prompt (TTFT = that end -
arrival); each later token out of one decode iteration; TPOT = (finish - first token) / (output - 1).

Deterministic for a seed. With one request at a time, one output token and a chunk that holds a prompt, it is an
M/D/1 (or G/D/1) queue, and the tests hold it to the closed forms.
"""

from __future__ import annotations

import bisect
import collections
import enum
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from openk3.checks import check_int, check_number
from openk3.planner.perf import Scenario, evaluate


class Arrivals(str, enum.Enum):
    POISSON = "poisson"
    BURSTY = "bursty"


@dataclass(frozen=True)
class QueueOptions:
    """How the plan's queueing check simulates its rate: arrival process, burstiness, how many requests, the seed."""

    arrivals: Arrivals = Arrivals.POISSON
    cv2: float = 4.0
    requests: int = 2000
    seed: int = 0

    def at(self, rate: float) -> QueueSpec:
        return QueueSpec(rate, self.arrivals, self.cv2, self.requests, self.seed)


@dataclass(frozen=True)
class QueueSpec:
    rate: float  # requests/s into this replica
    arrivals: Arrivals = Arrivals.POISSON
    cv2: float = 4.0  # squared coefficient of variation of the gaps when bursty
    requests: int = 2000
    seed: int = 0

    def __post_init__(self) -> None:
        check_number("QueueSpec", "rate", self.rate, low=0)
        if not self.rate > 0:
            raise ValueError(f"QueueSpec.rate={self.rate!r} is invalid: expected requests per second > 0")
        check_number("QueueSpec", "cv2", self.cv2, low=1)
        check_int("QueueSpec", "requests", self.requests, low=10)

    def gaps(self) -> list[float]:
        rng = random.Random(self.seed)
        mean = 1 / self.rate
        if self.arrivals == Arrivals.POISSON:
            return [rng.expovariate(self.rate) for _ in range(self.requests)]
        shape = 1 / self.cv2  # gamma with mean `mean` and variance cv2 x mean^2
        return [rng.gammavariate(shape, mean / shape) for _ in range(self.requests)]


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p90: float
    p99: float
    mean: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        s = sorted(values)

        def q(p: float) -> float:
            return s[min(len(s) - 1, max(0, math.ceil(p * len(s)) - 1))]  # nearest rank

        return cls(q(0.5), q(0.9), q(0.99), sum(s) / len(s))

    def at(self, name: str) -> float:
        return float(getattr(self, name))


@dataclass(frozen=True)
class QueueStats:
    spec: QueueSpec
    ttft: Percentiles
    tpot: Percentiles | None  # None when every request has one output token
    utilisation: float  # busy time / simulated time
    max_queue: int


@dataclass(frozen=True)
class SLOPercentile:
    """The highest of p50 / p90 / p99 at which both TTFT and the per-user speed (1 / TPOT) meet the SLO."""

    percentile: str | None  # "p99", "p90", "p50", or None when even the median misses

    @classmethod
    def of(cls, stats: QueueStats, max_ttft_s: float, min_user_tok_s: float) -> SLOPercentile:
        for p in ("p99", "p90", "p50"):
            speed_ok = stats.tpot is None or min_user_tok_s <= 0 or 1 / stats.tpot.at(p) >= min_user_tok_s
            if stats.ttft.at(p) <= max_ttft_s and speed_ok:
                return cls(p)
        return cls(None)


StepCost = Callable[[int, int], float]  # (decoding requests, prefill tokens) -> seconds


def simulate(requests: Sequence[tuple[int, int]], spec: QueueSpec, step_s: StepCost, max_batch: int, chunk: int) -> QueueStats:
    """Run `spec.requests` arrivals through the scheduler; each request's (input, output) pair is drawn from `requests`
    (equally likely, seeded)."""
    check_int("simulate", "max_batch", max_batch, low=1)
    check_int("simulate", "chunk", chunk, low=1)
    arrivals, t = [], 0.0
    for g in spec.gaps():
        t += g
        arrivals.append(t)
    pick = random.Random(spec.seed + 1)
    pairs = [requests[0] if len(requests) == 1 else requests[pick.randrange(len(requests))] for _ in arrivals]
    left = [p for p, _ in pairs]  # prompt tokens still to prefill
    out_left = [o for _, o in pairs]
    first, finish = [math.nan] * len(arrivals), [math.nan] * len(arrivals)
    waiting: collections.deque[int] = collections.deque()
    running: list[int] = []  # admitted, oldest first
    nxt, now, busy, max_queue = 0, 0.0, 0.0, 0
    while nxt < len(arrivals) or waiting or running:
        if not waiting and not running:
            now = max(now, arrivals[nxt])
        while nxt < len(arrivals) and arrivals[nxt] <= now:
            waiting.append(nxt)
            nxt += 1
        max_queue = max(max_queue, len(waiting))
        while waiting and len(running) < max_batch:
            running.append(waiting.popleft())
        budget, prefilling = chunk, []
        for r in running:
            if left[r] > 0 and budget > 0:
                take = min(left[r], budget)
                prefilling.append((r, take))
                budget -= take
        decoding = [r for r in running if left[r] == 0]
        dt = step_s(len(decoding), chunk - budget)
        now += dt
        busy += dt
        for r, take in prefilling:
            left[r] -= take
            if left[r] == 0:
                first[r] = now
                out_left[r] -= 1
        for r in decoding:
            out_left[r] -= 1
        for r in [r for r in running if left[r] == 0 and out_left[r] == 0]:
            finish[r] = now
            running.remove(r)
    ttft = [first[i] - arrivals[i] for i in range(len(arrivals))]
    tpots = [(finish[i] - first[i]) / (pairs[i][1] - 1) for i in range(len(arrivals)) if pairs[i][1] > 1]
    return QueueStats(spec, Percentiles.of(ttft), Percentiles.of(tpots) if tpots else None, busy / now, max_queue)


def interpolated(points: Sequence[tuple[int, float]]) -> Callable[[int], float]:
    """Linear interpolation over (batch, seconds) points, held at the ends: the decode step between evaluated batches."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]

    def f(n: int) -> float:
        if n <= xs[0]:
            return ys[0]
        if n >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_right(xs, n)
        w = (n - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + w * (ys[i] - ys[i - 1])

    return f


def replica_queue(sc: Scenario, pairs: Sequence[tuple[int, int]], spec: QueueSpec) -> QueueStats:
    """The simulation on `sc`'s replica: at most its planned batch running, chunks of `prefill_chunk` per attention
    group (one replica iteration takes dp of them), an iteration costing the planner's per-token decode time at that
    batch (evaluated at powers of two and interpolated) plus the chunk at the replica's prefill throughput."""
    batch = max(1, sc.workload.concurrency)
    grid = sorted({1, batch, *(2**i for i in range(int(math.log2(batch)) + 1))})
    per_token = [(n, 1 / evaluate(sc.with_(workload=replace(sc.workload, concurrency=n))).per_user_tok_s) for n in grid]
    decode = interpolated(per_token)
    prefill_tok_s = evaluate(sc).prefill_tok_s

    def step(decoding: int, prefill_tokens: int) -> float:
        return (decode(decoding) if decoding else 0.0) + prefill_tokens / prefill_tok_s

    return simulate(pairs, spec, step, batch, sc.workload.prefill_chunk * sc.layout.dp)


def describe_queue(stats: QueueStats, met: SLOPercentile, replicas: int) -> list[str]:
    s = stats.spec
    how = "Poisson" if s.arrivals == Arrivals.POISSON else f"bursty (gamma gaps, cv^2 {s.cv2:g})"
    lines = [
        f"queueing ({how} arrivals at {s.rate:.3g} requests/s per replica x {replicas}; {s.requests:,} simulated requests, seed {s.seed}; "
        f"iterating {stats.utilisation:.0%} of the time, longest queue {stats.max_queue}):",
        f"  TTFT p50 / p90 / p99 {stats.ttft.p50:.2f} / {stats.ttft.p90:.2f} / {stats.ttft.p99:.2f} s",
    ]
    if stats.tpot is not None:
        t = stats.tpot
        lines.append(f"  TPOT p50 / p90 / p99 {t.p50 * 1e3:.1f} / {t.p90 * 1e3:.1f} / {t.p99 * 1e3:.1f} ms ({1 / t.p90:.1f} tok/s per user at p90)")
    lines.append(f"  the SLO holds at {met.percentile} of requests" if met.percentile else "  the SLO is missed even at the median under queueing")
    return lines
