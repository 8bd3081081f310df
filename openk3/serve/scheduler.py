"""The rule: every request owns `num_computed_tokens`, and each step gives each scheduled request the tokens it still lacks
(`num_tokens - num_computed_tokens`, prompt and outputs alike) within the step's token budget -- prefill, chunked prefill,
recompute after preemption and decode are all this one rule.

Order of a step: running requests first (oldest first), each capped by the budget and `long_prefill_token_threshold`;
when pages run out the newest running request is preempted (its pages and slot freed, back to the front of the waiting
queue, recomputed from token 0 later). Then, if nothing was preempted, waiting requests are admitted while a slot,
pages, budget and `max_num_seqs` allow, in FIFO order with one exception that keeps one caller from starving the rest:
the n samples of one caller's request (its `group`) take turns with other requests -- the next admitted is the waiting
request whose group has the fewest running samples (preempted ones first, then arrival order). With n = 1 everywhere
that is plain FIFO. That is the fcfs policy; the priority and fair policies (serve/policy.py) order the waiting queue by
(priority, [client's running requests,] arrival) instead, choose the preemption victim by the same order, admit after a
preemption only a request that outranks a running one, let it preempt for its own admission, and keep its first chunk out
of the budget of the requests it outranks. What goes to the runner is the plan of the step: the scheduled requests
themselves, in batch order, with the tokens each computes; the runner reads their tokens from the Request and their slot
and pages from the cache. Prefix caching adds one thing to admission: a new request starts at the deepest boundary cached
under its cache_salt (`num_computed_tokens` = the hit; none for a request that wants its prompt scored,
serve/prompt_logprobs.py), and states are snapshotted where the prefix cache wants them (serve/snapshot_points.py: chunk
ends, the prompt end, branch points and the deepest match-unit multiples inside a step) and when a request finishes.
Images: a chunk whose images are not encoded yet also spends their token count of the budget (the encoder runs in that
step, serve/encoder_cache.py); the prefix cache keys image tokens by image.
Single-threaded: the engine loop calls schedule / update_from_output / finish in turn.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from openk3.checks import check_int
from openk3.serve.cache.manager import CacheManager
from openk3.serve.cache.prefix_types import PrefixMatch
from openk3.serve.policy import POLICIES, Ranking, SchedulingPolicy, check_priority
from openk3.serve.request import Request, RequestStatus
from openk3.serve.shared_prefill import prefill_to_wait_for, unfinished_prefills, wants_whole_prompt
from openk3.serve.snapshot_points import SnapshotCut, chunk_tokens, reserve_cuts, snapshot_due


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    long_prefill_token_threshold: int | None = None  # most tokens one request gets per step (the prefill chunk size)
    policy: SchedulingPolicy = SchedulingPolicy.FCFS

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"SchedulerConfig.policy={self.policy!r}: expected one of {', '.join(POLICIES)}")
        object.__setattr__(self, "policy", SchedulingPolicy(self.policy))
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            check_int("SchedulerConfig", name, getattr(self, name), low=1)
        check_int("SchedulerConfig", "long_prefill_token_threshold", self.long_prefill_token_threshold, low=1, optional=True)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan: the scheduled requests in batch order, how many tokens each computes, and the states to take
    inside the step."""

    requests: tuple[Request, ...]
    num_tokens: tuple[int, ...]
    cuts: tuple[SnapshotCut, ...] = ()

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        """Request id -> tokens this step, in batch order."""
        return {r.request_id: n for r, n in zip(self.requests, self.num_tokens, strict=True)}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheManager) -> None:
        self.config = config
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        # set by the engine when its model encodes images: the extra budget a chunk costs (its images not yet encoded)
        self.encoder_cost: Callable[[Request, int], int] | None = None
        self._arrivals = itertools.count()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        check_priority(self.config.policy, req.priority, req.request_id)
        self.requests[req.request_id] = req
        req.arrival_seq = next(self._arrivals)
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def _chunk(self, req: Request, budget: int, start: int | None = None) -> int:
        """The tokens req computes this step from `start` (its computed count): the budget, the prefill threshold, and
        inside the prompt a chunk end where a state is worth taking (serve/snapshot_points.py)."""
        c = req.num_computed_tokens if start is None else start
        n = min(req.num_tokens - c, budget)
        if self.config.long_prefill_token_threshold is not None:
            n = min(n, self.config.long_prefill_token_threshold)
        return chunk_tokens(self.cache.prefix_config, req, n, c)

    def _admit(self, req: Request, budget: int) -> int | None:
        """Take cache for a waiting request (from its deepest cached prefix when prefix caching is on); the tokens it gets this
        step, or None when the cache cannot hold it now."""
        if self.cache.prefix is None:
            n = self._chunk(req, budget)
            return None if self.cache.allocate(req.request_id, req.num_computed_tokens + n) is None else n
        tokens = req.cache_key_ids()  # image tokens keyed by their image (serve/media_prompt.py)
        # a cached prefix has no logits to score and no routing to record, so a request that wants either computes it all
        skip = wants_whole_prompt(req)
        match = PrefixMatch.miss() if skip else self.cache.fetch(self.cache.match_prefix(tokens, req.cache_salt))
        start = match.num_tokens
        # A branch point: the index holds this prompt's tokens up to `matched` but no state there, so take a state exactly
        # there. A repeated prompt branches one token before its end (a hit must leave the last token to compute).
        branch = min(match.matched_tokens, req.num_prompt_tokens - 1)
        if branch > start:
            req.snapshot_points = tuple(sorted({*req.snapshot_points, branch}))
        n = self._chunk(req, budget, start)
        if not self.cache.allocate_prefixed(req.request_id, tokens, match, start + n, req.cache_salt):
            return None
        req.num_computed_tokens = start
        if req.num_preemptions == 0:
            req.num_cached_tokens = start
        return n

    def _next_waiting(self, waiting: Sequence[Request], running_per_group: Counter[str]) -> Request:
        """The waiting request whose turn it is (module docstring): O(1) while every group is a single request."""
        head = waiting[0]
        if not running_per_group or head.status == RequestStatus.PREEMPTED or running_per_group[head.group] == 0:
            return head  # nothing beats a preempted request, or one whose group has nothing running
        return min(waiting, key=lambda r: (r.status != RequestStatus.PREEMPTED, running_per_group[r.group]))  # min is stable: arrival order

    def _waits_for_shared_prefill(self, req: Request, ranking: Ranking | None) -> bool:
        """Whether `req` stays waiting for a running prompt's prefill that will cache a prefix it shares
        (serve/shared_prefill.py); if so that prefill is asked for a state at the shared depth. Never for a request it
        outranks: the step keeps budget from that one for it, so the prefill might not advance at all."""
        pc = self.cache.prefix_config
        if pc is None or not pc.shared_prefill or req.status == RequestStatus.PREEMPTED or wants_whole_prompt(req):
            return False
        prefilling = [r for r in unfinished_prefills(self.running) if ranking is None or not ranking.outranks(req, r)]
        if not prefilling:
            return False
        tokens = req.cache_key_ids()  # a waiting request that was never preempted: its prompt
        cached = self.cache.match_prefix(tokens, req.cache_salt).num_tokens
        wait = prefill_to_wait_for(req, tokens, cached, prefilling, pc.match_unit)
        if wait is None:
            return False
        if wait.depth < wait.running.num_prompt_tokens:  # the prompt's end is snapshotted anyway
            wait.running.snapshot_points = tuple(sorted({*wait.running.snapshot_points, wait.depth}))
        assert self.cache.prefix is not None
        self.cache.prefix.counters.shared_prefill_waits += 1
        return True

    def _preempt(self, req: Request) -> None:
        self.cache.free(req.request_id)
        req.draft_token_ids, req.draft_probs = [], None
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)

    def _victim(self, i: int, ranking: Ranking | None) -> Request:
        """The running request that gives way when running[i] needs pages: one not yet scheduled this step (running[i:])."""
        return self.running[-1] if ranking is None else ranking.last(self.running[i:])

    def _displace(self, head: Request, ranking: Ranking, scheduled: list[Request], counts: list[int], preempted: list[Request]) -> bool:
        """Preempt, for the waiting `head`, the running request ranked last among those it outranks (taking it out of this
        step's plan); False when it outranks none."""
        outranked = [r for r in self.running if ranking.outranks(head, r)]
        if not outranked:
            return False
        victim = ranking.last(outranked)
        if victim in scheduled:
            j = scheduled.index(victim)
            del scheduled[j], counts[j]
        self.running.remove(victim)
        ranking.removed(victim)
        self._preempt(victim)
        preempted.append(victim)
        return True

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[Request] = []
        counts: list[int] = []
        preempted: list[Request] = []
        ranking = None if self.config.policy is SchedulingPolicy.FCFS else Ranking(self.config.policy, self.running)
        head = None if ranking is None else ranking.contender(self.waiting, self.running)
        reserve = 0 if head is None else self._chunk(head, budget)  # kept from the requests head outranks

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            room = budget - reserve if head is not None and ranking is not None and ranking.outranks(head, req) else budget
            if room <= 0:
                i += 1
                continue
            n = self._chunk(req, room)
            assert n > 0, f"running request {req.request_id} has nothing to compute"
            k = len(req.draft_token_ids)
            if k and n == req.num_tokens - req.num_computed_tokens and n + k <= room:
                n += k  # its drafts are verified in this step (serve/speculative.py)
            else:
                req.draft_token_ids, req.draft_probs = [], None
            new_pages = self.cache.allocate(req.request_id, req.num_computed_tokens + n)
            while new_pages is None:
                victim = self._victim(i, ranking)
                self.running.remove(victim)
                if ranking is not None:
                    ranking.removed(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
                new_pages = self.cache.allocate(req.request_id, req.num_computed_tokens + n)
            if new_pages is None:
                continue  # req itself was preempted; running[i] is now the next request (or the loop ends)
            scheduled.append(req)
            counts.append(n)
            budget -= n + (self.encoder_cost(req, n) if self.encoder_cost is not None else 0)
            i += 1

        now = time.monotonic()
        running_per_group = Counter(r.group for r in self.running)
        # the waiting requests this step may still admit: a copy once one of them waits for a running prompt's prefill
        # (serve/shared_prefill.py), from which it is then dropped (one C-level scan, not a rebuild per admission)
        waiting: deque[Request] | list[Request] = self.waiting
        while waiting and budget > 0:
            if ranking is None:
                if preempted or len(self.running) >= self.config.max_num_seqs:
                    break  # pages ran short this step: admitting more would only preempt more
                req = self._next_waiting(waiting, running_per_group)
            else:
                req = ranking.first(waiting)
                # after a preemption only a request that outranks a running one is worth the pages, and never the one preempted
                if req in preempted or (preempted and not any(ranking.outranks(req, r) for r in self.running)):
                    break
            if self._waits_for_shared_prefill(req, ranking):
                waiting = list(waiting) if waiting is self.waiting else waiting
                waiting.remove(req)
                continue
            admitted = self._admit(req, budget) if len(self.running) < self.config.max_num_seqs else None
            while admitted is None and ranking is not None and self._displace(req, ranking, scheduled, counts, preempted):
                budget = self.config.max_num_batched_tokens - sum(counts)
                admitted = self._admit(req, budget) if len(self.running) < self.config.max_num_seqs else None
            if admitted is None:
                break  # later requests wait behind the one whose turn it is rather than overtaking it
            self.waiting.remove(req)
            if waiting is not self.waiting:
                waiting.remove(req)
            running_per_group[req.group] += 1
            if ranking is not None:
                ranking.admitted(req)
            req.status = RequestStatus.RUNNING
            if req.timings.first_scheduled is None:
                req.timings.first_scheduled = now
            self.running.append(req)
            scheduled.append(req)
            counts.append(admitted)
            budget -= admitted + (self.encoder_cost(req, admitted) if self.encoder_cost is not None else 0)

        cuts = reserve_cuts(self.cache.prefix_config, scheduled, counts, self.cache.reserve_snapshot_slot)
        return SchedulerOutput(tuple(scheduled), tuple(counts), cuts)

    def update_from_output(self, out: SchedulerOutput, sampled: Mapping[str, int], runs: Mapping[str, list[int]] | None = None) -> list[Request]:
        """Advance computed counts and append the sampled tokens (request id -> token, only for the requests whose
        computed tokens caught up this step) and the runs of speculating requests (request id -> the tokens kept: the
        runner left its state covering all but the last, and the pages of the rest are released); returns the requests
        that received tokens, in batch order."""
        for cut in out.cuts:
            req = out.requests[cut.row]
            if req.status == RequestStatus.RUNNING:
                self.cache.adopt_snapshot(req.request_id, req.cache_key_ids(cut.num_tokens), cut.slot, req.cache_salt)
            else:
                self.cache.release_snapshot_slot(cut.slot)  # it ended while the step ran: its pages may be gone
        got_token = []
        for req, n in zip(out.requests, out.num_tokens, strict=True):
            req.draft_token_ids, req.draft_probs = [], None
            if req.status != RequestStatus.RUNNING:
                continue  # finished or aborted while the step ran
            run = None if runs is None else runs.get(req.request_id)
            if run is not None:
                req.token_ids.extend(run)
                req.num_computed_tokens = req.num_tokens - 1
                self.cache.trim(req.request_id, req.num_tokens)
                got_token.append(req)
                continue
            req.num_computed_tokens += n
            if snapshot_due(self.cache.prefix_config, req):
                self.cache.snapshot(req.request_id, req.cache_key_ids(req.num_computed_tokens), req.cache_salt)
            token = sampled.get(req.request_id)
            if token is None:
                continue
            assert req.num_computed_tokens == req.num_tokens, f"{req.request_id} sampled before its computed tokens caught up"
            req.append_output(token)
            got_token.append(req)
        return got_token

    def finish(self, req_id: str, status: RequestStatus) -> None:
        """End a request (stop, length or abort) wherever it is and free its cache; unknown or finished ids are ignored."""
        if not status.finished:
            raise ValueError(f"Scheduler.finish: status {status} is not a finished status")
        req = self.requests.pop(req_id, None)
        if req is None:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            # a stop string inside a speculative run leaves the state past its tokens (engine.py): nothing to snapshot then
            if self.cache.prefix is not None and 0 < req.num_computed_tokens < req.num_tokens:
                self.cache.snapshot(req_id, req.cache_key_ids(req.num_computed_tokens), req.cache_salt)  # the next turn of a conversation
        else:
            self.waiting.remove(req)
        if self.cache.holds(req_id):
            self.cache.free(req_id)
        req.status = status

    def check_integrity(self) -> None:
        self.cache.check_integrity()
        for req in self.running:
            if req.status != RequestStatus.RUNNING or not self.cache.holds(req.request_id):
                held = self.cache.holds(req.request_id)
                raise AssertionError(f"Scheduler: running request {req.request_id} has status {req.status}, holds cache: {held}")
            if not 0 <= req.num_computed_tokens < req.num_tokens:
                raise AssertionError(f"Scheduler: running request {req.request_id} computed {req.num_computed_tokens} of {req.num_tokens}")
        for req in self.waiting:
            if self.cache.holds(req.request_id) or req.num_computed_tokens != 0:
                raise AssertionError(f"Scheduler: waiting request {req.request_id} holds cache or has computed tokens")
        ids = [r.request_id for r in self.running] + [r.request_id for r in self.waiting]
        if sorted(ids) != sorted(self.requests):
            raise AssertionError("Scheduler: running + waiting differ from the known requests")
