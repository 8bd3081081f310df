"""DataParallelEngine: rank 0's engine as the LLM (or a server) sees it when attention is data-parallel; `run_dp_worker`:
every other rank's loop.

Each DP rank holds an LLMEngine of its own: its scheduler, its cache pools and prefix cache, its sampler; only the MoE
layers span ranks (expert parallelism, each rank dispatching its own tokens). Rank 0 holds rank 0's engine, the router
that places each request on a rank (router.py), and per remote request what it has seen of it. A step (`step()`):

1. scatter: each rank receives the requests placed on it since the last step and the ones to end (channel.py);
2. every rank applies them, steps its engine if it has work, and runs exactly one forward (lockstep.py: a dummy when
   its engine ran none), so every MoE collective has every rank;
3. gather: rank 0 receives every rank's outputs and returns them merged, as LLMEngine.step does.

Remote requests are ended (finish/abort) by a command at the next step; outputs a rank sent for a request rank 0 has
already ended are dropped. The metrics finish() returns for a remote request are rank 0's own observations (arrival,
first and last token as rank 0 received them); its queue time is unknown there (None) and its preemptions are not
reported (0). Sampling: per-request seeds give the single process's tokens; the engines' own generators (unseeded
sampling) are seeded seed + rank.

Behind the server (`openk3 serve --dp D --ep D`) it is the AsyncEngine's engine (serve/engine.py ServedEngine): stats()
sums every rank's last report (rank_stats.py), `cache` is rank 0's (the layout every rank's pools share), and a remote
request counts as scheduled once its rank reports it is no longer waiting (the server's queue limits read that).
`ep_totals` is what the server's `openk3:ep_*` metrics read: rank 0's EP stats after each step, every rank's entries
(rank_stats.py add_ep_step); every rank drains its own backend's each step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from openk3.config import ModelConfig
from openk3.config.vision import VisionConfig
from openk3.parallel.dp.channel import AddRequest, DPChannel, FinishRequest, Inbox, Outbox
from openk3.parallel.dp.lockstep import LockstepModel
from openk3.parallel.dp.rank_stats import LeaderEPStats, add_ep_step, merge_engine_stats
from openk3.parallel.dp.router import DPRouter
from openk3.parallel.serving.driver import EPTotals
from openk3.parallel.serving.heartbeat import RankHeartbeat
from openk3.serve.cache.manager import CacheManager
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.engine_api import EngineStats
from openk3.serve.media_prompt import ImageSpan
from openk3.serve.policy import check_priority
from openk3.serve.request import EngineCoreOutput, RequestMetrics, RequestStatus
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import Tokenizer

log = logging.getLogger("openk3.parallel.dp")


@dataclass
class _Remote:
    """What rank 0 knows of a request another rank runs."""

    rank: int
    arrival: float
    num_prompt_tokens: int
    first_token: float | None = None
    last_token: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    sent: bool = False  # scattered to its rank
    scheduled: bool = False  # its rank has scheduled it (reported after the step that did)

    def metrics(self, now: float) -> RequestMetrics:
        ttft = None if self.first_token is None else self.first_token - self.arrival
        decode = None if self.first_token is None or self.last_token is None else self.last_token - self.first_token
        return RequestMetrics(self.arrival, None, ttft, now - self.arrival, self.num_prompt_tokens, self.num_output_tokens, 0, self.num_cached_tokens, decode)


@dataclass
class _RankState:
    stats: EngineStats  # as last reported
    pending: list[AddRequest | FinishRequest] = field(default_factory=list)
    unfinished: int = 0


class DataParallelEngine:
    def __init__(self, local: LLMEngine, lockstep: LockstepModel, channel: DPChannel, heartbeat: RankHeartbeat | None = None) -> None:
        self.local, self.lockstep, self.channel = local, lockstep, channel
        self.heartbeat = heartbeat  # started; its owner adds what a lost rank means (LocalEP, the server's rank 0)
        self.num_ranks = channel.ctx.world_size
        self.router = DPRouter(self.num_ranks, local.config.prefix_match_unit)
        # until a rank reports after its first step it holds nothing, in pools the size of rank 0's (same settings)
        idle = local.stats()
        self._ranks = [_RankState(idle) for _ in range(self.num_ranks)]
        self._remote: dict[str, _Remote] = {}
        self._ep_stats = LeaderEPStats(lockstep.model)
        self.ep_totals = EPTotals()
        self._closed = False
        self._failure: str | None = None
        self.steps = 0

    @property
    def failed(self) -> bool:
        """A step failed: the other ranks may be stuck inside its collectives; close() then sends nothing."""
        return self._failure is not None or self.lockstep.failed or self._lost()

    def _lost(self) -> bool:
        return self.heartbeat is not None and self.heartbeat.lost is not None

    # what OutputProcessor and LLM read of an engine
    @property
    def tokenizer(self) -> Tokenizer:
        return self.local.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.local.model_config

    @property
    def max_model_len(self) -> int:
        return self.local.max_model_len

    @property
    def vision(self) -> VisionConfig | None:
        return None  # add_request refuses images with dp > 1

    @property
    def model(self) -> LockstepModel:
        return self.lockstep

    # what the server reads besides (serve/engine.py ServedEngine)
    @property
    def config(self) -> EngineConfig:
        return self.local.config  # every rank's, but for the seed of its unseeded sampling

    @property
    def num_engines(self) -> int:
        return self.num_ranks

    @property
    def weight_version(self) -> int:
        return self.local.weight_version  # never counts up: weight updates refuse data-parallel engines (parallel/weight_update.py)

    @property
    def cache(self) -> CacheManager:
        return self.local.cache  # rank 0's, for the layout every rank's pools share; stats() has every rank's use

    def was_scheduled(self, request_id: str) -> bool | None:
        rank = self.router.rank_of(request_id)
        if rank is None:
            return None
        if rank == 0:
            return self.local.was_scheduled(request_id)
        return self._remote[request_id].scheduled

    def check_integrity(self) -> None:
        """Rank 0's engine's (the other ranks' engines are not reachable between steps)."""
        self.local.check_integrity()

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        group_id: str | None = None,
        images: tuple[ImageSpan, ...] = (),
    ) -> None:
        if images:
            raise ValueError("image input is not supported with data parallelism (dp > 1) yet: serve a vision model on one engine")
        params = params or SamplingParams()
        ids = list(prompt_token_ids)
        if self.router.rank_of(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.local.check_prompt(ids)  # every rank's engine has the same limits: refuse here, before it is placed
        check_priority(self.local.scheduler.config.policy, params.priority, request_id)
        rank = self.router.place(request_id, ids, params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids))
        if rank == 0:
            try:
                self.local.add_request(request_id, ids, params, group_id)
            except BaseException:
                self.router.release(request_id)
                raise
            return
        self._ranks[rank].pending.append(AddRequest(request_id, tuple(ids), params, group_id))
        self._remote[request_id] = _Remote(rank, time.monotonic(), len(ids))

    def finish(self, request_id: str, status: RequestStatus) -> RequestMetrics | None:
        rank = self.router.rank_of(request_id)
        if rank is None:
            return None
        self.router.release(request_id)
        if rank == 0:
            return self.local.finish(request_id, status)
        remote = self._remote.pop(request_id)
        pending = self._ranks[rank].pending
        if remote.sent:
            pending.append(FinishRequest(request_id, status))
        else:  # ended before its rank ever received it (a client gone at once): it is simply not sent
            pending[:] = [c for c in pending if not (isinstance(c, AddRequest) and c.request_id == request_id)]
        return remote.metrics(time.monotonic())

    def abort(self, request_id: str) -> None:
        self.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return self.router.num_placed > 0 or any(r.pending for r in self._ranks)

    def step(self) -> list[EngineCoreOutput]:
        """One lockstep step of every DP rank (module docstring); the outputs of every rank's requests."""
        if self._closed:
            raise RuntimeError("DataParallelEngine: closed (the DP workers have stopped)")
        if self._failure is None and self.heartbeat is not None and self.heartbeat.lost is not None:
            self._failure = str(self.heartbeat.lost)
        if self._failure is not None:
            raise RuntimeError(f"DataParallelEngine: an earlier step failed ({self._failure}); the DP group is unusable, close it and start again")
        inboxes = [Inbox(tuple(r.pending)) for r in self._ranks]
        for r in self._ranks:
            for command in r.pending:
                if isinstance(command, AddRequest):
                    self._remote[command.request_id].sent = True
            r.pending = []
        try:
            self.channel.scatter(inboxes)
            outputs = self.local.step() if self.local.has_unfinished() else []
            self.lockstep.end_step()
            gathered = self.channel.gather(Outbox(tuple(outputs), self.local.stats(), int(self.local.has_unfinished())))
        except BaseException as e:
            self._failure = f"{type(e).__name__}: {e}"
            raise
        assert gathered is not None
        self.steps += 1
        add_ep_step(self.ep_totals, self._ep_stats.drain(), gathered)
        merged = list(outputs)
        now = time.monotonic()
        waiting = {request_id for box in gathered for request_id in box.unscheduled}
        for request_id, placed in self._remote.items():
            placed.scheduled = placed.scheduled or (placed.sent and request_id not in waiting)
        for rank, box in enumerate(gathered):
            self._ranks[rank].stats, self._ranks[rank].unfinished = box.stats, box.unfinished
            if rank == 0:
                continue
            for out in box.outputs:
                remote = self._remote.get(out.request_id)
                if remote is None:
                    continue  # ended by rank 0 while this rank was still sampling it
                remote.first_token = remote.first_token or now
                remote.last_token = now
                remote.num_output_tokens += len(out.new_token_ids)
                remote.num_cached_tokens = out.num_cached_tokens
                if out.finished:
                    del self._remote[out.request_id]
                merged.append(out)
        for out in merged:
            if out.finished:
                self.router.release(out.request_id)
        return merged

    def stats(self) -> EngineStats:
        """Every rank's last reported stats, summed (rank_stats.py)."""
        return merge_engine_stats([r.stats for r in self._ranks])

    def rank_stats(self) -> list[EngineStats]:
        return [r.stats for r in self._ranks]

    def close(self) -> None:
        """STOP to every rank, then rank 0's own engine (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._lost():
            # the step's thread may be inside a collective with the lost rank (holding the TP driver's lock): touch nothing
            return
        try:
            if self._failure is None:
                if self.heartbeat is not None:
                    self.heartbeat.stop()  # every rank's heartbeat ends in the same round, before the ranks leave
                self.channel.scatter([Inbox(stop=True)] * self.num_ranks)
                self.channel.barrier()
        finally:
            try:
                self.local.close()
            finally:
                self.lockstep.close()


def run_dp_worker(engine: LLMEngine, lockstep: LockstepModel, channel: DPChannel) -> int:
    """A DP rank's loop until rank 0 sends STOP; returns the steps run."""
    steps = requests = 0
    ep_stats = LeaderEPStats(lockstep.model)
    try:
        while True:
            inbox = channel.scatter(None)
            if inbox.stop:
                channel.barrier()
                log.info("DP rank %d: %d requests served in %d steps", channel.ctx.rank, requests, steps)
                return steps
            for command in inbox.commands:
                if isinstance(command, AddRequest):
                    engine.add_request(command.request_id, list(command.prompt_token_ids), command.params, command.group_id)
                    requests += 1
                else:
                    engine.finish(command.request_id, command.status)
            outputs = engine.step() if engine.has_unfinished() else []
            lockstep.end_step()
            ep_stats.drain()  # every rank's entries are in rank 0's stats too
            channel.gather(Outbox(tuple(outputs), engine.stats(), int(engine.has_unfinished()), tuple(engine.unscheduled_request_ids())))
            steps += 1
    finally:
        try:
            engine.close()
        finally:
            lockstep.close()
