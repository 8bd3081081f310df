"""The messages of one context-parallel prefill: the prompt's tokens split over W ranks in order, and what the ranks send.

Legend: W ranks, T prompt tokens, T_r rank r's tokens (positions [lo_r, hi_r)), R the MLA latent width.

Two patterns, both exact: an all-gather of rows (the MLA latents, the logits; gloo's all_gather wants equal shapes, so
each rank pads its rows to the largest shard), and point-to-point hand-offs: from rank r to rank r + 1 (the KDA conv
window, and without the scan the recurrent state) and, with `--kda-cp scan`, the state maps of kda_scan.py's rounds
(rank r to r + 2^d). Sends are `isend`, so that the sender goes on with its own work while the message travels; `recv`
blocks, and the time spent there is recorded. Every received payload is logged per layer, which is what the planner's
CP term predicts (benchmarks/context_parallel.py); padding is logged apart as `padding_bytes`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from openk3.parallel.group import ParallelContext


def shard_bounds(num_tokens: int, world_size: int) -> list[tuple[int, int]]:
    """Contiguous, in-order shards whose sizes differ by at most one token (the first ranks take the extra ones)."""
    if world_size < 1 or num_tokens < world_size:
        raise ValueError(f"context parallel: {num_tokens} prompt tokens over cp={world_size} ranks, expected at least one token per rank")
    base, extra = divmod(num_tokens, world_size)
    bounds, lo = [], 0
    for r in range(world_size):
        hi = lo + base + (1 if r < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


@dataclass(frozen=True)
class Received:
    """One exchange as seen by the receiving rank: which layer ("logits" for the head), what, and its payload bytes."""

    layer: int | None
    what: str  # "mla_latent" | "kda_conv" | "kda_state" | "kda_scan" | "final_state" | "cut_state" | "logits"
    nbytes: int


@dataclass
class CPExchange:
    """This rank's side of one CP prefill; `finish()` must run before the sent tensors may be touched again."""

    ctx: ParallelContext
    shards: Sequence[tuple[int, int]]
    context_len: int = 0  # tokens of the sequence already in the cache before the first shard
    received: list[Received] = field(default_factory=list)
    padding_bytes: int = 0
    wait_s: float = 0.0  # time spent blocked in recv, waiting for the previous rank's state
    _pending: list[tuple[dist.Work, torch.Tensor]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.shards) != self.ctx.world_size:
            raise ValueError(f"CPExchange: {len(self.shards)} shards for {self.ctx.world_size} ranks")

    @property
    def rank(self) -> int:
        return self.ctx.rank

    @property
    def last(self) -> int:
        return self.ctx.world_size - 1

    def _global(self, rank: int) -> int:
        assert self.ctx.group is not None
        return dist.get_global_rank(self.ctx.group, rank)

    def gather_rows(self, rows: torch.Tensor, layer: int | None, what: str) -> torch.Tensor:
        """[T, ...]: every rank's rows [T_r, ...] in rank order (this rank's own rows included, as computed)."""
        if not self.ctx.connected():
            return rows
        sizes = [hi - lo for lo, hi in self.shards]
        width = max(sizes)
        padded = rows.new_zeros((width, *rows.shape[1:]))
        padded[: rows.shape[0]] = rows
        parts = self.ctx.all_gather(padded)
        row_bytes = rows[:1].numel() * rows.element_size()
        self.received.append(Received(layer, what, (sum(sizes) - sizes[self.rank]) * row_bytes))
        self.padding_bytes += sum(width - n for r, n in enumerate(sizes) if r != self.rank) * row_bytes
        return torch.cat([parts[r, :n] for r, n in enumerate(sizes)], dim=0)

    def send(self, t: torch.Tensor, dst: int, tag: int) -> None:
        """Hand `t` to rank `dst` of the group without waiting for it to arrive."""
        buf = t.contiguous()
        work = dist.isend(buf, dst=self._global(dst), group=self.ctx.group, tag=tag)
        assert work is not None
        self._pending.append((work, buf))

    def recv(self, like: torch.Tensor, src: int, layer: int, what: str, tag: int) -> torch.Tensor:
        """Rank `src`'s message (shape and dtype of `like`); the time blocked is recorded."""
        out = torch.empty_like(like)
        start = time.perf_counter()
        dist.recv(out, src=self._global(src), group=self.ctx.group, tag=tag)
        self.wait_s += time.perf_counter() - start
        self.received.append(Received(layer, what, out.numel() * out.element_size()))
        return out

    def from_previous(self, like: torch.Tensor, layer: int, what: str, tag: int) -> torch.Tensor | None:
        """Rank r - 1's hand-off (shape and dtype of `like`); None on rank 0, which starts the prompt."""
        return None if self.rank == 0 else self.recv(like, self.rank - 1, layer, what, tag)

    def to_next(self, t: torch.Tensor, tag: int) -> None:
        """Hand `t` to rank r + 1 without waiting for it to arrive (nothing on the last rank)."""
        if self.rank != self.last:
            self.send(t, self.rank + 1, tag)

    def from_rank(self, t: torch.Tensor, src: int, layer: int, what: str) -> torch.Tensor:
        """Rank `src`'s `t` on every rank (the state after the whole prompt from the last rank; a prefix-cache snapshot
        from the rank whose shard holds its position)."""
        if not self.ctx.connected():
            return t
        buf = t.contiguous().clone()
        dist.broadcast(buf, src=self._global(src), group=self.ctx.group)
        if self.rank != src:
            self.received.append(Received(layer, what, buf.numel() * buf.element_size()))
        return buf

    def finish(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def bytes_by_layer(self, what: str) -> dict[int | None, int]:
        out: dict[int | None, int] = {}
        for r in self.received:
            if r.what == what:
                out[r.layer] = out.get(r.layer, 0) + r.nbytes
        return out
