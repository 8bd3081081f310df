"""Serving expert-parallel with rank 0 as the driver: `EPDriver` on rank 0, `run_worker` on every other rank.

Requests arrive only at rank 0 and sampling without a seed differs per process, so the ranks must not step engines of
their own. Rank 0 runs the one real engine (scheduler, runner, sampler) with an EPDriver in place of the model: just
before each model call the driver broadcasts the step's ForwardBatch (step_channel.py), then runs the expert-parallel
model. Each worker runs the same forward on the same batch with cache pools of its own, of rank 0's shapes, and
discards the logits. Every rank attaches its model with `replicated_tokens=True` (TokenSplit): each dispatches 1/W of
the tokens and all ranks end every MoE layer with the same rows. The engine and runner need no change: the driver obeys
the runner's CausalLM contract.

Contract: the engine's cache pools are mutated by model calls and by the prefix cache's slot and page copies. The
driver turns on the pools' copy log (CacheTensors.copy_log) at its first call -- no copy can come earlier: a copy's
source is written by a forward -- and sends the copies made since the last step just before each step (COPIES), which
every worker replays on its own pools, so the same slot and page ids hold the same (per-rank) contents everywhere. Host
and disk tier loads write rank 0's pools from rank 0's buffers: where the workers' pools are replicas of rank 0's
(`replicas`: no TP shard, as with --cp or --ep over TP groups of one) each load goes in the log with its buffer and the
workers unpack it too. Where the workers hold TP shards, rank 0's prefix cache logs what its host tier does instead
(offloads, spills to disk, loads, drops), and each worker repeats it on its own pools and TierMirror
(serve/cache/tier_mirror.py), whose disk entries are files of its own under the same disk_offload_dir.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Protocol

import torch

from openk3.config import ModelConfig
from openk3.model.batch import CacheTensors, ForwardBatch
from openk3.parallel.ep.stats import EPStats
from openk3.parallel.serving.heartbeat import RankHeartbeat
from openk3.parallel.serving.step_channel import CacheShape, CopyLog, StepChannel
from openk3.serve.cache.tier_mirror import TierMirror
from openk3.serve.cache.transfer import replay


class ForwardModel(Protocol):
    config: ModelConfig

    def __call__(self, batch: ForwardBatch, cache: CacheTensors | None) -> torch.Tensor: ...

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...


class StatsSource(Protocol):
    def drain_stats(self) -> list[EPStats]: ...


class EPTotals:
    """What rank 0's EP backend reported so far: per MoE layer the last step's stats, and running totals.

    Entries and rows per rank are global (the backends all-gather them); bytes are rank 0's own sends. Written by the
    thread that runs the model, read by the metrics between steps on that same thread. Fed by the EPDriver after each
    forward (`serve --ep N`), or by the DataParallelEngine after each lockstep step (`serve --dp D`, dp/rank_stats.py),
    with the number of DP ranks whose engine had nothing to run and that ran the one-token dummy forward instead: those
    tokens are routed and computed too, so their entries are in the stats.
    """

    def __init__(self) -> None:
        self.steps = 0
        self.last: dict[int, EPStats] = {}
        self.recv_entries_R: list[int] = []
        self.bytes_sent = 0
        self.prefetch_bytes = 0
        self.spilled = 0
        self.dummy_forwards = 0

    def add(self, stats: list[EPStats], dummy_forwards: int = 0) -> None:
        if not stats:
            return
        self.steps += 1
        self.dummy_forwards += dummy_forwards
        for s in stats:
            self.last[s.layer_index] = s
            if not self.recv_entries_R:
                self.recv_entries_R = [0] * len(s.recv_entries_R)
            self.recv_entries_R = [a + b for a, b in zip(self.recv_entries_R, s.recv_entries_R, strict=True)]
            self.bytes_sent += s.bytes_sent
            self.prefetch_bytes += s.prefetch_bytes
            self.spilled += s.spilled


class EPDriver:
    """Rank 0's model as the engine sees it: broadcast the step, then run the expert-parallel model on it.

    A lock makes a whole step (broadcast and forward) and close() exclusive, so a close from another thread never lands
    between a header and its payload, nor while this rank is inside a step's collectives.

    Failure: once a step's broadcast has begun, any exception (here or in the model) leaves the workers inside that step's
    collectives, waiting for this rank. The driver is then `failed` (as it is once its heartbeat has lost a rank): later
    calls raise at once, and close() sends no STOP (the workers could not read it); the owner must tear the group down
    instead (destroy it, kill local workers).
    """

    def __init__(
        self, model: ForwardModel, channel: StepChannel, stats: StatsSource | None = None, heartbeat: RankHeartbeat | None = None, replicas: bool = False
    ) -> None:
        self.model, self.channel, self.stats = model, channel, stats
        self.replicas = replicas  # the workers' pools hold rank 0's very contents (no TP shard): tier loads are replayed too
        self.heartbeat = heartbeat  # started; its owner adds what a lost rank means (LocalEP, the server's rank 0)
        self.config = model.config
        self.totals = EPTotals()
        self.last_stats: list[EPStats] = []  # what the backend reported in the last forward (also added to totals)
        self._cache: CacheTensors | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._failure: str | None = None

    def __call__(self, batch: ForwardBatch, cache: CacheTensors | None) -> torch.Tensor:
        """A step of the engine's, or (cache None: a batch without cache slots) a cache-free forward such as the dummy
        step of an idle data-parallel rank (dp/lockstep.py), which the workers run without their pools."""
        with self._lock:
            if self._failure is None and self.heartbeat is not None and self.heartbeat.lost is not None:
                self._failure = str(self.heartbeat.lost)
            if self._failure is not None:
                raise RuntimeError(f"EPDriver: an earlier step failed ({self._failure}); the expert-parallel group is unusable, close it and start again")
            if self._closed:
                raise RuntimeError("EPDriver: closed (the expert-parallel workers have stopped)")
            if cache is not None and self._cache is not None and cache is not self._cache:
                raise ValueError("EPDriver: one driver serves one engine's cache pools; the workers mirror only the first")
            if (cache is None) != (batch.state_slots is None):
                raise ValueError("EPDriver: a batch with cache slots needs the cache pools, and a cache-free batch none")
            header, payload = self.channel.encode_step(batch)  # a batch the channel refuses fails before anything is sent
            try:
                if cache is not None and self._cache is None:
                    self.channel.send_cache(cache)
                    self._cache = cache
                    cache.copy_log = []
                    cache.mirrors_replicate = self.replicas
                if cache is not None and cache.copy_log:
                    self.channel.send_copies(cache.copy_log)
                    cache.copy_log.clear()
                self.channel.send_encoded(header, payload)
                logits = self.model(batch, cache)
            except BaseException as e:
                self._failure = f"{type(e).__name__}: {e}"
                raise
            if self.stats is not None:
                self.last_stats = self.stats.drain_stats()
                self.totals.add(self.last_stats)
            return logits

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        return self.model.parameters(recurse)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def failed(self) -> bool:
        return self._failure is not None or (self.heartbeat is not None and self.heartbeat.lost is not None)

    def close(self) -> None:
        """Idempotent. Healthy: STOP and a barrier with every worker. Failed: nothing is sent (see the class docstring)."""
        if self.heartbeat is not None and self.heartbeat.lost is not None:
            # the step's thread may hold the lock inside a collective with the lost rank, which returns only at the group's
            # timeout: waiting for the lock would hold the process that long, and there is nothing to send anyway
            self._closed = True
            return
        with self._lock:
            if not self._closed:
                self._closed = True
                if not self.failed:
                    if self.heartbeat is not None:
                        self.heartbeat.stop()  # every rank's heartbeat ends in the same round, before the workers leave
                    self.channel.send_stop()


def run_worker(model: ForwardModel, channel: StepChannel, device: torch.device | str, stats: StatsSource | None = None, disk_dir: str | None = None) -> int:
    """A worker rank's loop until rank 0 sends STOP; returns the number of steps run. Cache pools are allocated when rank 0
    announces their shapes; stats (when the backend collects them) are drained and dropped, rank 0 reports them.
    `disk_dir`: the engine's disk_offload_dir, where this rank keeps its shards of rank 0's disk tier entries."""
    # rank 0's tiers, in this rank's own shards (used when rank 0 has any and this rank's pools are shards)
    mirror = TierMirror(disk_dir)
    try:
        return _worker_loop(model, channel, device, stats, mirror)
    finally:
        mirror.close()


def _worker_loop(model: ForwardModel, channel: StepChannel, device: torch.device | str, stats: StatsSource | None, mirror: TierMirror) -> int:
    cache: CacheTensors | None = None
    steps = 0
    while True:
        message = channel.receive(device)
        if message is None:
            return steps
        if isinstance(message, CacheShape):
            cache = message.allocate(model.config, device)
            continue
        if isinstance(message, CopyLog):
            if cache is None:
                raise RuntimeError("expert-parallel worker: rank 0 sent cache copies before announcing its cache shapes")
            replay(cache, message.copies, mirror)
            continue
        if message.uses_cache and cache is None:
            raise RuntimeError("expert-parallel worker: rank 0 sent a step before announcing its cache shapes")
        mirror.step()
        with torch.inference_mode():
            model(message, cache if message.uses_cache else None)
        if stats is not None:
            stats.drain_stats()
        steps += 1
