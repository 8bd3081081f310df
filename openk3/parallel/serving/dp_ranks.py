"""Start-up of data-parallel attention (dp groups of tp ranks; rank_groups.py), the same on every rank:

- a DP group's TP rank 0 (its leader) builds its shard, opens the group's step channel when tp > 1 (its TP ranks follow
  its EPDriver, as in one-engine serving), wraps the model in a LockstepModel and runs an LLMEngine of its own; rank 0's
  leader steps every group (DataParallelEngine), the other leaders run `run_dp_worker`;
- the other ranks of a DP group run the step-channel worker loop of their leader.

Failures at start-up are reported twice over: inside a DP group (its step channel's handshake) and among the leaders
(the DP channel's), so rank 0 raises the first failing rank's error and every rank leaves.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable
from pathlib import Path

import torch

from openk3.parallel.dp.channel import DPChannel
from openk3.parallel.dp.engine import DataParallelEngine, run_dp_worker
from openk3.parallel.dp.lockstep import LockstepModel
from openk3.parallel.group import ParallelContext
from openk3.parallel.serving.driver import EPDriver, ForwardModel, run_worker
from openk3.parallel.serving.heartbeat import RankHeartbeat, exit_worker
from openk3.parallel.serving.rank_groups import RankGroups, rank_groups
from openk3.parallel.serving.ranks import RankModelSpec, build_rank_model
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.generation_config import read_generation_config
from openk3.serve.loading import model_tokenizer, resolve_model
from openk3.serve.tokenizer import ByteTokenizer, Tokenizer


def checkpoint_eos(source: object) -> tuple[int, ...]:
    """The end tokens of the checkpoint's generation_config.json, which each leader's engine stops on as one process does
    (every leader reads the folder it loads its weights from); none for a module or a preset."""
    folder = resolve_model(source) if isinstance(source, (str, Path)) else None
    return read_generation_config(folder).eos_token_ids


def _failure(rank: int, error: BaseException) -> str:
    return f"rank {rank}: {type(error).__name__}: {error}"


class _Leader:
    """A DP group's leader once built: its engine (over its LockstepModel) and the channels it reports on."""

    def __init__(self, groups: RankGroups, spec: RankModelSpec, config: EngineConfig, tokenizer: Tokenizer | None) -> None:
        assert groups.leaders is not None
        self.tp_channel = groups.tp_channel
        self.dp_channel = DPChannel(groups.leaders)
        self.error: str | None = None
        self.engine: LLMEngine | None = None
        self.lockstep: LockstepModel | None = None
        try:
            model, backend = build_rank_model(spec, groups.world, groups.tp)
        except Exception as e:
            self.error = _failure(groups.world.rank, e)
            if self.tp_channel is not None:
                self.tp_channel.report_ready(self.error)
            return
        forward: ForwardModel = model
        if self.tp_channel is not None:
            failures = [f for f in self.tp_channel.report_ready(None) if f is not None]
            if failures:
                self.error = "; ".join(failures)
                return
            forward = EPDriver(model, self.tp_channel, getattr(backend, "inner", None))
        self.lockstep = LockstepModel(forward, groups.world.device)
        try:
            if tokenizer is None:  # a leader's engine needs only the end-of-sequence id, which rank 0's tokenizer has
                source = spec.source
                tokenizer = ByteTokenizer(max(256, model.config.vocab_size)) if isinstance(source, torch.nn.Module) else model_tokenizer(source, config.seed)
            # distinct streams for unseeded sampling; the named ops are the spec's, selected as the rank built its shard
            rank_config = dataclasses.replace(config, seed=config.seed + groups.dp_rank)
            self.engine = LLMEngine(self.lockstep, tokenizer, rank_config, checkpoint_eos(spec.source))
        except Exception as e:  # reported in the leaders' handshake (every rank then leaves), not left for them to wait on
            self.error = _failure(groups.world.rank, e)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self.lockstep is not None:
            self.lockstep.close()


def run_dp_worker_rank(world: ParallelContext, spec: RankModelSpec, config: EngineConfig, timeout: datetime.timedelta | None = None) -> int:
    """Any rank but 0 of a data-parallel layout, from its groups to STOP; returns the steps it ran."""
    heartbeat = RankHeartbeat(world.rank, spec.heartbeat_timeout_s)  # first: every rank creates its groups in one order
    groups = rank_groups(world, spec.tp, spec.dp, timeout)
    if not groups.is_leader:
        channel = groups.tp_channel
        assert channel is not None  # a rank that is no leader is in a TP group of more than one
        try:
            model, backend = build_rank_model(spec, groups.world, groups.tp)
        except Exception as e:
            channel.report_ready(_failure(world.rank, e))
            raise
        if any(channel.report_ready(None)):
            return 0
        return _beating(heartbeat, lambda: run_worker(model, channel, world.device, getattr(backend, "inner", None), spec.disk_dir))
    leader = _Leader(groups, spec, config, None)
    if any(leader.dp_channel.report_ready(leader.error)):
        leader.close()
        return 0
    engine, lockstep = leader.engine, leader.lockstep
    assert engine is not None and lockstep is not None
    return _beating(heartbeat, lambda: run_dp_worker(engine, lockstep, leader.dp_channel))


def _beating(heartbeat: RankHeartbeat, loop: Callable[[], int]) -> int:
    """A worker's loop with its heartbeat running; a lost rank ends the process (this rank may be stuck with it)."""
    heartbeat.on_lost(exit_worker)
    heartbeat.start()
    steps = loop()
    heartbeat.stop()  # rank 0 stopped every heartbeat before its STOP (or a start-up failure left none beating)
    return steps


def start_dp_leader(
    world: ParallelContext, spec: RankModelSpec, config: EngineConfig, tokenizer: Tokenizer, timeout: datetime.timedelta | None = None
) -> DataParallelEngine:
    """Rank 0 of a data-parallel layout: its groups, its own DP group's engine, the handshakes, and the engine the
    caller steps. Raises the first error of any rank that failed to start."""
    heartbeat = RankHeartbeat(world.rank, spec.heartbeat_timeout_s)
    groups = rank_groups(world, spec.tp, spec.dp, timeout)
    leader = _Leader(groups, spec, config, tokenizer)
    failures = [f for f in leader.dp_channel.report_ready(leader.error) if f is not None]
    if failures:
        leader.close()
        raise RuntimeError(f"multi-rank start-up failed on {len(failures)} rank(s): " + "; ".join(failures))
    assert leader.engine is not None and leader.lockstep is not None
    return DataParallelEngine(leader.engine, leader.lockstep, leader.dp_channel, heartbeat.start())
