"""Scheduling policies: which waiting request is admitted next, and which running request gives way to it.

- fcfs (the default, vLLM's): arrival order, with scheduler.py's turn-taking between the n samples of one request; a
  request's `priority` must be 0 (the engine refuses any other value rather than ignore it).
- priority (vLLM's `--scheduling-policy priority`): the waiting request with the lowest (priority, arrival) goes first.
  When it cannot be admitted (no free sequence slot or pages), a running request with a strictly larger priority value is
  preempted for it, and out of the step's token budget its first chunk is kept back from such requests, so a more urgent
  request is admitted in the first step after it arrives unless the whole batch is as urgent as it.
- fair: `priority` first, then the client (SamplingParams.client: the API's `user`, docs/serving.md; a request that names
  none counts as a client of its own, its n samples together) with the fewest running requests, then arrival: clients
  take turns for free slots, so one client's flood waits behind everyone else's requests.
  A running request also gives way (preempted, recomputed later) to a waiting request of the same priority whose client
  runs at least two fewer requests than its own -- after the swap its client still runs at least as many as the other,
  so the two never trade places back and forth. Hence a request from a client with nothing running, arriving while one
  client fills every slot with two or more requests, is admitted in the first step that follows, given that its first
  chunk fits the step budget and the pages of those requests (the bound tests/serve/test_policy.py checks).

Preemption keeps scheduler.py's rule (cache freed, recomputed from token 0); only the choice of the victim differs: the
newest running request under fcfs, the one ranked last (largest priority value, then most-served client, then newest)
otherwise. Ordering is by each request's arrival number, never by wall time, so the order is exact and testable.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Sequence

from openk3.serve.request import Request

POLICIES = ("fcfs", "priority", "fair")


class SchedulingPolicy(str, enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"
    FAIR = "fair"


def check_priority(policy: SchedulingPolicy, priority: int, request_id: str) -> None:
    """fcfs cannot honour a priority other than 0: a clear error instead of a request served out of the order it asked."""
    if policy is SchedulingPolicy.FCFS and priority != 0:
        raise ValueError(
            f"request {request_id!r}: priority={priority} needs priority scheduling; this engine runs scheduling_policy='fcfs' "
            "(start it with --scheduling-policy priority or fair)"
        )


class Ranking:
    """A policy's order over requests, given how many requests each client runs (`running`, updated by the caller as
    requests are admitted and preempted within a step)."""

    def __init__(self, policy: SchedulingPolicy, running: Iterable[Request]) -> None:
        if policy is SchedulingPolicy.FCFS:
            raise ValueError("Ranking: fcfs keeps the scheduler's own arrival order (scheduler.py)")
        self.policy = policy
        self.running: Counter[tuple[str, str]] = Counter(r.client for r in running)

    def key(self, req: Request) -> tuple[int, int, int]:
        """Smaller is served first."""
        share = self.running[req.client] if self.policy is SchedulingPolicy.FAIR else 0
        return (req.priority, share, req.arrival_seq)

    def first(self, waiting: Iterable[Request]) -> Request:
        return min(waiting, key=self.key)

    def last(self, candidates: Sequence[Request]) -> Request:
        """The request that gives way first: ranked last (with its own client's count, it being one of the running)."""
        return max(candidates, key=self.key)

    def contender(self, waiting: Sequence[Request], running: Sequence[Request]) -> Request | None:
        """The first waiting request when it outranks a running one (the one a step makes room for), else None."""
        if not waiting:
            return None
        head = self.first(waiting)
        return head if any(self.outranks(head, r) for r in running) else None

    def outranks(self, head: Request, running: Request) -> bool:
        """Whether the waiting `head` may take the place of `running` (module docstring)."""
        if running.priority != head.priority:
            return running.priority > head.priority
        return self.policy is SchedulingPolicy.FAIR and self.running[running.client] >= self.running[head.client] + 2

    def admitted(self, req: Request) -> None:
        self.running[req.client] += 1

    def removed(self, req: Request) -> None:
        self.running[req.client] -= 1
