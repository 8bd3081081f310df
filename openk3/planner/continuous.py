"""The steady state of an in-flight (continuous) batching engine at full load: each step decodes every running request
and spends what is left of its token budget on prompt chunks, in the same forward pass (issue 37 item 1).

TensorRT-LLM, vLLM and SGLang schedule this way: a step holds the decode rows of the requests past their prompt and the
chunks of the prompts being prefilled, at most `token_budget` tokens in all, and at most the admitted requests (the
batch cap or the KV cache's count, whichever is lower). Such a step is not a pure prefill step plus a pure decode step:
the weights are read once for both, the GEMMs run at the sum of their tokens, and the two attentions are separate
kernels (`perf.batch_step` with a `PrefillChunk`). With every request queued at once and fixed lengths (`trtllm-bench throughput`), per
attention-DP group, in steps:

- a request spends c steps in its prompt, then OSL - 1 steps decoding (its first token comes with its last prompt chunk);
  with `lam` requests finishing per step, D = lam (OSL - 1) rows decode and lam ISL prompt tokens are prefilled per step
  on average, and lam c requests are in their prompt (Little's law);
- the admitted requests hold the slots: D + lam c <= N; the budget holds the tokens: D + lam ISL <= token_budget;
  c = max(1, ISL / (budget - D)): a prompt takes at least one step, longer ones as many as its chunks need;
- lam is the largest value both allow (a fixed point, since c grows with D). Prompt tokens are not spread thinly: a step
  that carries them carries min(budget - D, max(ISL, lam ISL)) (one prompt when fewer than one arrives per step, what
  arrived otherwise), so a share f = lam ISL / that of the steps is mixed and the rest decode only (and run the
  captured CUDA graph, padded);
- output tokens per second = lam OSL x groups / (f x mixed step + (1 - f) x decode step).

A benchmark of a fixed number of requests is not all steady state: it starts with every slot prefilling and nothing
decoding, and ends with the last requests decoding at a falling batch. `finite_run` steps through such a run. Not
modelled: eviction (TensorRT-LLM's default admission reserves a whole request), uneven requests per attention-DP group
(split evenly; the busiest group sets the wall time) and queues per group that drift apart.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from openk3.checks import check_int
from openk3.planner.perf import Scenario, batch_step
from openk3.planner.steps import PrefillChunk, StepTime

FIXED_POINT_ROUNDS = 60


@dataclass(frozen=True)
class SteadyState:
    requests_per_step: float  # lam, per attention-DP group
    decode_rows: float  # D, per group
    prompt_steps: float  # c: steps a prompt takes
    mixed_share: float  # f: share of steps that carry prompt tokens
    chunk: PrefillChunk  # what such a step carries, per group
    mixed: StepTime
    decode: StepTime
    limit: str  # "requests" (the admitted requests) or "token budget"
    output_tok_s: float  # of the instance

    @property
    def step_s(self) -> float:
        return self.mixed_share * self.mixed.total_s + (1 - self.mixed_share) * self.decode.total_s


def _rate(n: float, isl: int, osl: int, budget: int) -> tuple[float, float, str]:
    """(lam, c, what binds) for `n` admitted requests per group."""
    lam, c = 0.0, 1.0
    by_budget = budget / (osl - 1 + isl)
    for _ in range(FIXED_POINT_ROUNDS):
        c = max(1.0, isl / max(budget - lam * (osl - 1), 1.0))
        lam = min(n / (osl - 1 + c), by_budget)
    return lam, c, "token budget" if lam >= by_budget else "requests"


def steady_state(sc: Scenario, isl: int, osl: int, token_budget: int) -> SteadyState:
    """The steady state of `sc`'s instance admitting `sc.workload.concurrency` requests of `isl` prompt and `osl`
    output tokens, with `token_budget` tokens per step per attention-DP group; decode rows attend to the workload's
    context (the time-average cache of a decoding request)."""
    for name, value in (("isl", isl), ("osl", osl), ("token_budget", token_budget)):
        check_int("steady_state", name, value, low=1)
    n = sc.workload.concurrency / sc.layout.dp
    if n < 1:
        raise ValueError(f"steady_state needs at least one request per attention-DP group; got {sc.workload.concurrency} over {sc.layout.dp}")
    lam, c, limit = _rate(n, isl, osl, token_budget)
    rows = lam * (osl - 1)
    per_step = lam * isl
    carried = min(max(token_budget - rows, 1.0), max(float(isl), per_step))
    chunk = PrefillChunk(tokens=carried, prompts=max(1.0, carried / isl), mean_keys=(isl + 1) / 2, prompt_tokens=float(isl))
    share = min(1.0, per_step / carried)
    mixed = batch_step(sc, rows, chunk)
    decode = batch_step(sc, rows)
    step = share * mixed.total_s + (1 - share) * decode.total_s
    return SteadyState(lam, rows, c, share, chunk, mixed, decode, limit, lam * osl * sc.layout.dp / step)


@dataclass(frozen=True)
class FiniteRun:
    """A run of `requests` requests queued at once, served to the last (`finite_run`)."""

    requests: int
    steps: int  # per attention-DP group
    seconds: float
    output_tok_s: float  # of the instance: output tokens / the run's wall time
    steady: SteadyState  # the same engine's steady state, for comparison


def _prefill(waiting: list[list[float]], budget: float, isl: int) -> tuple[float, float, float, float]:
    """Fill `budget` prompt tokens first come first served from `waiting` ([requests, tokens already prefilled] per
    cohort, updated in place); a request that does not fit whole gets the rest of the budget as a chunk. Returns
    (requests finishing their prompt, prompt tokens, prompts touched, key-query pairs)."""
    done = tokens = prompts = pairs = 0.0
    i = 0
    while i < len(waiting) and budget >= 1:
        count, have = waiting[i]
        need = isl - have
        whole = min(count, budget // need)
        if whole:
            done, tokens, prompts, budget = done + whole, tokens + whole * need, prompts + whole, budget - whole * need
            pairs += whole * need * (have + (need + 1) / 2)
            count -= whole
        if count and budget >= 1:  # one request's chunk: the rest of the budget
            part = min(budget, need)
            tokens, prompts, budget = tokens + part, prompts + 1, 0.0
            pairs += part * (have + (part + 1) / 2)
            waiting[i] = [1, have + part]
            if count > 1:
                waiting.insert(i + 1, [count - 1, have])
            break
        if count:
            waiting[i][0] = count
            i += 1
        else:
            waiting.pop(i)
    return done, tokens, prompts, pairs


GRID_STEP = 1.01  # step shapes above 100 are priced on a geometric grid 1% apart


def _grid(x: float) -> float:
    """Prompt-chunk shapes priced on a grid (three significant figures below 100, 1% apart above: a price < 0.5% off), so
    a run of thousands of steps prices each distinct shape once. Decode rows are not gridded: a captured graph's padding
    jumps at its sizes."""
    if x <= 0:
        return 0.0
    if x < 100:
        return float(round(x, 2 - math.floor(math.log10(x))))
    return GRID_STEP ** round(math.log(x, GRID_STEP))


def finite_run(sc: Scenario, isl: int, osl: int, token_budget: int, requests: int) -> FiniteRun:
    """`requests` requests of `isl`/`osl` tokens queued at once and split evenly over the attention-DP groups, each
    group admitting up to `sc.workload.concurrency / dp` at a time: the steps of the steady state's rule (decode rows
    first, prompt chunks first come first served in what is left of the budget), run step by step from the first
    admission to the last output token. Includes the start (prompts with nothing yet decoding) and the drain (the last
    requests decoding at a falling batch) that a benchmark's wall time counts."""
    check_int("finite_run", "requests", requests, low=1)
    steady = steady_state(sc, isl, osl, token_budget)
    n = int(sc.workload.concurrency / sc.layout.dp)
    queued = float(-(-requests // sc.layout.dp))  # the busiest group sets the wall time
    waiting: list[list[float]] = []  # [requests, prompt tokens prefilled]
    decoding: deque[tuple[float, int]] = deque()  # (requests, the step after which they finish), in finishing order
    held = rows = 0.0
    step = 0
    seconds = 0.0
    prices: dict[tuple[float, float, float, float], float] = {}
    while queued or waiting or decoding:
        admit = min(n - held, queued)
        if admit > 0:
            waiting.append([admit, 0.0])
            queued, held = queued - admit, held + admit
        done, tokens, prompts, pairs = _prefill(waiting, token_budget - rows, isl)
        key = (rows, _grid(tokens), _grid(prompts), _grid(pairs / tokens) if tokens else 0.0)  # rows exact: graphs pad by them
        if key not in prices:
            chunk = PrefillChunk(key[1], max(key[2], 1.0), key[3], float(isl)) if tokens else None
            prices[key] = batch_step(sc, key[0], chunk).total_s
        repeats = 1
        if not tokens and not waiting and decoding and (queued < 1 or held >= n):  # decode only until the next finish
            repeats = decoding[0][1] - step + 1
        seconds += repeats * prices[key]
        step += repeats - 1
        if done:  # their first token came with the last chunk; osl - 1 decode steps follow
            decoding.append((done, step + osl - 1))
            rows += done if osl > 1 else 0.0
        while decoding and decoding[0][1] <= step:
            finished = decoding.popleft()[0]
            held -= finished
            rows -= finished if osl > 1 else 0.0
        step += 1
    tok_s = requests * osl / seconds if seconds else 0.0
    return FiniteRun(requests, step, seconds, tok_s, steady)
