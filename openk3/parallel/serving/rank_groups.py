"""The process groups of one rank in a DP x TP or CP x TP layout, made once at start-up (context_parallel_groups: below).

Legend: W = dp * tp ranks; rank r is TP rank r % tp of DP group r // tp (a DP group's ranks are consecutive, so on one
node with GPUs in order they share the fastest links).

- world: every rank; the experts are spread over all of them (expert parallelism), each rank's MoE layers exchange
  tokens with every other;
- tp: the rank's tensor-parallel group (its all-reduces, TokenSplit's gather, its step channel); with dp = 1 it is the
  world itself (one engine over every rank), with dp > 1 and tp = 1 a group of one;
- leaders: with dp > 1, the TP rank 0 of every DP group (each runs its DP group's engine; rank 0's steps them all); None
  on the other ranks;
- tp_channel: with dp > 1 and tp > 1, the DP group's step channel (its leader drives its TP ranks, as one engine's rank
  0 drives its workers), made here because of the order below.
Groups are made with local synchronization (members only), so no rank waits for groups it is not in. torch names such
a group by its ranks and the number of groups the process has made so far, so every member of a group must have made
the same number of groups before it (else each waits under another name, for ever): the TP group and its channel come
first on every rank, the leaders' group, which only leaders make, last.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from openk3.parallel.group import ParallelContext
from openk3.parallel.serving.step_channel import StepChannel


@dataclass(frozen=True)
class RankGroups:
    world: ParallelContext
    tp: ParallelContext
    dp: int
    leaders: ParallelContext | None
    tp_channel: StepChannel | None = None

    @property
    def dp_rank(self) -> int:
        return self.world.rank // self.tp.world_size

    @property
    def is_leader(self) -> bool:
        return self.tp.rank == 0


def _subgroup(world: ParallelContext, ranks: list[int], timeout: datetime.timedelta | None) -> ParallelContext:
    if len(ranks) == 1:
        return ParallelContext.single(world.device)
    group = dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)
    return ParallelContext.from_group(world.device, group)


def rank_groups(world: ParallelContext, tp: int, dp: int, timeout: datetime.timedelta | None = None) -> RankGroups:
    """`timeout` bounds each collective of the new groups (the world's own, ep_timeout_s, is the natural choice)."""
    if tp < 1 or dp < 1 or tp * dp != world.world_size:
        raise ValueError(f"rank_groups: dp={dp} x tp={tp} ranks, but the world has {world.world_size}")
    if dp == 1:
        return RankGroups(world, world, 1, None)
    if tp == 1:
        return RankGroups(world, ParallelContext.single(world.device), dp, world)
    first = world.rank - world.rank % tp
    tp_ctx = _subgroup(world, list(range(first, first + tp)), timeout)
    tp_channel = StepChannel(tp_ctx)
    leaders = _subgroup(world, list(range(0, world.world_size, tp)), timeout) if world.rank == first else None
    return RankGroups(world, tp_ctx, dp, leaders, tp_channel)


@dataclass(frozen=True)
class ContextParallelGroups:
    """One rank's groups in a CP x TP layout (ParallelConfig cp > 1): rank r is TP rank r % tp of CP rank r // tp, so a
    CP rank's TP group is `tp` consecutive ranks (its all-reduce per sublayer is the heaviest traffic), and the CP group
    joins the ranks that hold the same TP shard (tp rank t: t, t + tp, ...), which exchange that shard's latents and KDA
    states. With tp = 1 the CP group is the world."""

    tp: ParallelContext
    cp: ParallelContext


def context_parallel_groups(world: ParallelContext, cp: int, tp: int, timeout: datetime.timedelta | None = None) -> ContextParallelGroups:
    """Collective over the world: every rank makes every TP group, then every CP group, in the same order (groups made
    with global synchronization, so no rank can name a group differently from its peers)."""
    if cp < 1 or tp < 1 or cp * tp != world.world_size:
        raise ValueError(f"context_parallel_groups: cp={cp} x tp={tp} ranks, but the world has {world.world_size}")
    if tp == 1:
        return ContextParallelGroups(ParallelContext.single(world.device), world)
    if cp == 1:
        return ContextParallelGroups(world, ParallelContext.single(world.device))
    tp_groups = [dist.new_group(list(range(c * tp, (c + 1) * tp)), timeout=timeout) for c in range(cp)]
    cp_groups = [dist.new_group(list(range(t, cp * tp, tp)), timeout=timeout) for t in range(tp)]
    return ContextParallelGroups(
        ParallelContext.from_group(world.device, tp_groups[world.rank // tp]), ParallelContext.from_group(world.device, cp_groups[world.rank % tp])
    )
