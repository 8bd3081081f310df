"""Shared prefill: a waiting request whose prompt shares an uncached prefix with a prompt being prefilled waits for it.

The prefix cache helps a request only once the state at a boundary of its prefix has been taken. Requests that arrive
together with the same new prefix -- conversations opening with one system prompt, the n samples of one prompt, an RL
group -- would otherwise all be admitted into the same step and each compute that prefix again. SGLang's scheduler holds
such requests back (its in-batch prefix caching); openk3's does the same: a waiting request whose prompt shares at least
one match unit more with a running request's *unfinished* prompt prefill than the cache gives it now stays waiting, and
the running request is asked for a state at the shared depth (a snapshot point, taken inside its step like any branch
point). When that state is in the cache the waiting request is admitted and starts there.

It cannot wait forever: it waits only while the other request is running and has not yet computed past the shared
depth, which it does within its prefill. If the state could not be kept (no snapshot slot free) the request is admitted
on the next step as a plain miss; if the other request is preempted or finishes it no longer holds anyone back.
Requests that compute their whole prompt anyway (prompt logprobs, routing records) and preempted requests (who go first)
never wait, nor does a request wait for one it outranks under the priority and fair policies (the step keeps budget
from that one for it, so its prefill might not advance). Other waiting requests may be admitted ahead of one that waits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from openk3.serve.request import Request


@dataclass(frozen=True)
class SharedPrefill:
    """`req` should wait for `running`, which will hold the state after the first `depth` tokens of both prompts."""

    running: Request
    depth: int


def common_prefix(a: Sequence[int], b: Sequence[int], unit: int) -> int:
    """The length of the common prefix of a and b, exact; compared a unit at a time first (list slices compare in C)."""
    n = min(len(a), len(b))
    i = 0
    while i + unit <= n and a[i : i + unit] == b[i : i + unit]:
        i += unit
    while i < n and a[i] == b[i]:
        i += 1
    return i


def unfinished_prefills(running: Iterable[Request]) -> list[Request]:
    """Running requests whose prompt is not computed yet (the only ones another request can wait for)."""
    return [r for r in running if r.num_computed_tokens < r.num_prompt_tokens]


def prefill_to_wait_for(req: Request, mine: Sequence[int], cached: int, prefilling: Sequence[Request], unit: int) -> SharedPrefill | None:
    """The prefill `req` should wait for (`mine`: its prompt as the prefix cache keys it): the one whose prompt shares the
    deepest prefix with req's, at least `unit` tokens beyond the `cached` tokens req could start from now and not yet
    computed by it; None when no prefill is worth it. The depth is capped at req's prompt minus one token (a hit leaves
    the last token to compute) and at the other prompt."""
    if cached + unit >= req.num_prompt_tokens:
        return None
    best: SharedPrefill | None = None
    for other in prefilling:
        if other.cache_salt != req.cache_salt or other is req:
            continue
        shared = common_prefix(mine, other.cache_key_ids(other.num_prompt_tokens), unit)
        depth = min(shared, req.num_prompt_tokens - 1, other.num_prompt_tokens)
        if depth - cached >= unit and depth > other.num_computed_tokens and (best is None or depth > best.depth):
            best = SharedPrefill(other, depth)
    return best


def wants_whole_prompt(req: Request) -> bool:
    """A request that computes its whole prompt whatever is cached (its prompt logprobs, or its routing, are recorded)."""
    p = req.sampling_params
    return (p.prompt_logprobs is not None and not req.num_output_tokens) or p.return_routing
