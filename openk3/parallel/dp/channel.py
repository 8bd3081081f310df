"""The per-step exchange between rank 0 (the DP front end) and the other DP ranks: one scatter of commands, one gather of
outputs, both of picklable objects over a gloo group of its own (a long timeout, like the EP step channel's: a worker
waits in it while the server is idle).

A step: rank 0 scatters each rank its Inbox (requests to add, requests to end, or STOP); every rank applies it, runs its
engine's step (and the lockstep forward), and rank 0 gathers every rank's Outbox (the step's outputs and its stats).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from openk3.parallel.group import ParallelContext
from openk3.parallel.serving.step_channel import IDLE_TIMEOUT
from openk3.serve.engine_api import EngineStats
from openk3.serve.request import EngineCoreOutput, RequestStatus
from openk3.serve.sampling import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    group_id: str | None


@dataclass(frozen=True)
class FinishRequest:
    request_id: str
    status: RequestStatus


@dataclass(frozen=True)
class Inbox:
    commands: tuple[AddRequest | FinishRequest, ...] = ()
    stop: bool = False


@dataclass(frozen=True)
class Outbox:
    outputs: tuple[EngineCoreOutput, ...]
    stats: EngineStats
    unfinished: int  # requests this rank's engine still holds
    unscheduled: tuple[str, ...] = ()  # its requests still waiting for their first step (the server's queue limits)


class DPChannel:
    """Every rank must construct it (group creation is collective), in the same order relative to other groups."""

    def __init__(self, ctx: ParallelContext) -> None:
        if ctx.group is None:
            raise ValueError("DPChannel: a world of one has no other DP rank")
        self.ctx = ctx
        # members only (local synchronization): a DP group's TP ranks open theirs without the other groups
        self.group = dist.new_group(dist.get_process_group_ranks(ctx.group), timeout=IDLE_TIMEOUT, backend="gloo", use_local_synchronization=True)
        self.src = dist.get_global_rank(ctx.group, 0)

    def report_ready(self, error: str | None) -> list[str | None]:
        """The start-up handshake: each rank reports None (engine built) or its error; all get all."""
        reports: list[str | None] = [None] * self.ctx.world_size
        dist.all_gather_object(reports, error, group=self.group)
        return reports

    def scatter(self, inboxes: list[Inbox] | None) -> Inbox:
        """Rank 0 gives one Inbox per rank (its own included); every rank returns its own."""
        if (inboxes is not None) != (self.ctx.rank == 0):
            raise RuntimeError(f"DPChannel.scatter: rank {self.ctx.rank} {'gave' if inboxes is not None else 'gave no'} inboxes; only rank 0 sends")
        out: list[Inbox | None] = [None]
        dist.scatter_object_list(out, list(inboxes) if inboxes is not None else None, src=self.src, group=self.group)
        got = out[0]
        assert isinstance(got, Inbox)
        return got

    def gather(self, outbox: Outbox) -> list[Outbox] | None:
        """Every rank's Outbox, in rank order, on rank 0 (None elsewhere)."""
        out: list[Any] | None = [None] * self.ctx.world_size if self.ctx.rank == 0 else None
        dist.gather_object(outbox, out, dst=self.src, group=self.group)
        return out

    def barrier(self) -> None:
        """After STOP: nobody tears the group down while another rank still reads from it (gloo aborts then)."""
        dist.barrier(group=self.group)
