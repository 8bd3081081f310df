"""The collectives and host reads of one MoE layer call, counted: what EPStats reports and what the tests assert.

Legend: W ranks, N rows exchanged along dim 0.

Every collective an EP backend issues for a layer goes through one `Tally` (a thin wrapper over the ParallelContext), and
so does every deliberate device -> host copy. The counts are the cost model that matters at decode: each collective is a
latency floor (tens of microseconds on NVLink, 92 layers per K3 step), and each host read stalls the CPU until the
device queue drains, which also rules out capturing the step in a CUDA graph. A world of one issues nothing and counts
nothing, so a single-rank backend reports zero collectives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from openk3.parallel.group import ParallelContext


class Tally:
    """Counts the collectives and host reads issued through it; one per layer call."""

    def __init__(self, ctx: ParallelContext) -> None:
        self.ctx = ctx
        self.collectives = 0
        self.host_reads = 0

    def _issued(self) -> None:
        if self.ctx.group is not None:
            self.collectives += 1

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        self._issued()
        return self.ctx.all_gather(t)

    def all_to_all(self, send_N: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]) -> torch.Tensor:
        self._issued()
        return self.ctx.all_to_all(send_N, send_counts, recv_counts)

    def all_to_all_even(self, send_WN: torch.Tensor) -> torch.Tensor:
        """[W, ...] with row w for rank w -> [W, ...] with row w from rank w; equal splits need no host-side sizes."""
        ones = [1] * self.ctx.world_size
        return self.all_to_all(send_WN, ones, ones)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """The deliberate device -> host copies of a layer call (a no-op copy on CPU, still counted)."""
        self.host_reads += 1
        return t.cpu()
