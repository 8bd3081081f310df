"""ParallelContext: the ranks and the expert-parallel group one process works with, passed explicitly (no module globals).

Legend: W ranks in the EP group, N rows of a tensor exchanged along dim 0.

Collectives go through this object so that a world of one needs no process group at all (the identity), and so that the
two facts every backend relies on live in one place: gloo has only the single-tensor all_to_all (`all_to_all_single`),
and NCCL wants its count tensors on the GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup | None  # the EP group; None only for a world of one (no collectives are issued)
    sizing_only: bool = False  # a rank's place without a group: shapes a model (meta device), any collective raises

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"ParallelContext: rank={self.rank}, world_size={self.world_size}, expected 0 <= rank < world_size")
        if self.group is None and self.world_size != 1 and not self.sizing_only:
            raise ValueError(f"ParallelContext: world_size={self.world_size} needs a process group (group=None only for one rank)")

    @classmethod
    def for_sizing(cls, rank: int, world_size: int) -> ParallelContext:
        """Rank `rank` of `world_size` with no process group: enough to cut a model on the meta device and count one
        rank's bytes (tests, capacity checks); running it raises at the first collective."""
        return cls(rank, world_size, torch.device("meta"), None, sizing_only=True)

    def connected(self) -> bool:
        """Whether collectives have ranks to talk to (False for one rank, which needs none); a sizing-only context raises."""
        if self.sizing_only and self.world_size > 1:
            raise RuntimeError(f"ParallelContext: rank {self.rank} of {self.world_size} was made for sizing only (no process group)")
        return self.group is not None

    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> ParallelContext:
        return cls(0, 1, torch.device(device), None)

    @classmethod
    def from_group(cls, device: str | torch.device, group: dist.ProcessGroup | None = None) -> ParallelContext:
        """The context of this process in `group` (the default world group when None); init_process_group must have run."""
        g = group if group is not None else dist.group.WORLD
        assert g is not None
        return cls(dist.get_rank(g), dist.get_world_size(g), torch.device(device), g)

    @property
    def backend_name(self) -> str:
        return "none" if self.group is None else str(dist.get_backend(self.group))

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[W, *t.shape]: every rank's `t` (same shape on every rank), stacked by rank."""
        if not self.connected():
            return t.unsqueeze(0)
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.stack(parts)

    def exchange_counts(self, send_counts: torch.Tensor) -> torch.Tensor:
        """send_counts [W, C] (row w: what this rank sends to rank w) -> [W, C] (row w: what rank w sends here)."""
        if not self.connected():
            return send_counts.clone()
        send = send_counts.to(self.device).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return recv.cpu()

    def all_to_all(self, send_N: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]) -> torch.Tensor:
        """Rows [N, ...] grouped by destination rank (send_counts[w] rows for rank w) -> rows from every rank, grouped by source."""
        if len(send_counts) != self.world_size or len(recv_counts) != self.world_size:
            raise ValueError(f"all_to_all: {len(send_counts)} send and {len(recv_counts)} receive counts, expected {self.world_size}")
        if sum(send_counts) != send_N.shape[0]:
            raise ValueError(f"all_to_all: send counts sum to {sum(send_counts)}, tensor has {send_N.shape[0]} rows")
        if not self.connected():
            return send_N
        out = send_N.new_empty((sum(recv_counts), *send_N.shape[1:]))
        dist.all_to_all_single(out, send_N.contiguous(), list(recv_counts), list(send_counts), group=self.group)
        return out
