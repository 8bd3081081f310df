"""The modules that carry tensor parallelism's collectives, each holding the same parameter (and state-dict key) as the
single-device module it replaces. Legend: T ranks, V vocabulary, D hidden, M rows.

- RowParallelLinear: input split over T (the rank's heads or intermediate slice), partial outputs summed by one
  all-reduce: the one collective of each attention and MLP sublayer.
- VocabParallelEmbedding: each rank holds V/T rows; a token outside the rank's rows reads zero, and the all-reduce adds
  the one rank's row that holds it (exact: every other term is zero).
- VocabParallelHead: each rank computes the logits of its V/T rows; an all-gather returns all V to every rank, so the
  sampler (rank 0's, which alone samples) sees the single-device logits and every sampling mode stays what it was.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from openk3.model.layers import Linear
from openk3.parallel.group import ParallelContext


def all_reduce_sum(ctx: ParallelContext, t: torch.Tensor) -> torch.Tensor:
    if not ctx.connected():
        return t
    t = t.contiguous()
    dist.all_reduce(t, group=ctx.group)
    return t


class RowParallelLinear(Linear):
    """Linear(in_features / T -> out_features) whose output is summed over the TP group."""

    ctx: ParallelContext

    def __init__(self, source: Linear, ctx: ParallelContext) -> None:
        if source.bias is not None:
            raise ValueError("RowParallelLinear: a bias would be added T times; the model's row-parallel projections have none")
        nn.Module.__init__(self)
        self.in_features, self.out_features = source.in_features, source.out_features
        self.weight = source.weight
        self.register_parameter("bias", None)
        self.linear = source.linear
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(self.ctx, super().forward(x))


class VocabParallelEmbedding(nn.Module):
    """Rows start .. start + V/T - 1 of the embedding (`weight`, as nn.Embedding names it)."""

    def __init__(self, weight: torch.Tensor, start: int, ctx: ParallelContext) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=weight.requires_grad)
        self.start, self.ctx = start, ctx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        rows = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce_sum(self.ctx, rows.masked_fill(outside.unsqueeze(-1), 0.0))


class VocabParallelHead(Linear):
    """The LM head's V/T rows; forward returns the whole [M, V] logits on every rank (rank order is vocabulary order)."""

    ctx: ParallelContext

    def __init__(self, source: Linear, ctx: ParallelContext) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = source.in_features, source.out_features
        self.weight = source.weight
        self.register_parameter("bias", None)
        self.linear = source.linear
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = super().forward(x)
        return torch.cat(list(self.ctx.all_gather(part).unbind(0)), dim=-1) if self.ctx.connected() else part
