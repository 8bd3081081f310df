"""Where a prompt's prefix-cache states are taken: the KDA layers' recurrent state cannot be cut back to an earlier token,
so a prefix is reusable only at depths where the scheduler snapshotted it while computing (docs/serving.md, prefix cache).

Three kinds of depth, each a rule over the request and the prefix-cache config:
- the end of a chunk (`chunk_tokens`): a prefill chunk is cut at the fixed `snapshot_interval` when asked, and moved down to
  a multiple of the match unit whenever it is cut anyway (by the budget or the prefill threshold), so that its end is a
  depth a later prompt can match;
- after a step (`snapshot_due`): the prompt's end, a multiple of the match unit, an interval, or a branch point the
  request was given (where another prompt diverges from it);
- inside a step without cutting it (`cut_points`, `reserve_cuts`: ForwardBatch.state_cuts): the branch points inside the
  chunk, then the deepest `prompt_snapshots` multiples of the match unit below the prompt's end -- so a repeated or
  extended prompt hits on its second send. Their slots are reserved when the step is planned and adopted after it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from openk3.serve.cache.prefix_types import PrefixCacheConfig
from openk3.serve.request import Request


class SnapshotCut(NamedTuple):
    """A prefix-cache snapshot taken inside a step: request `row` (in batch order) writes its state after its first
    `num_tokens` tokens into the reserved snapshot slot `slot`."""

    row: int
    num_tokens: int
    slot: int


def chunk_tokens(pc: PrefixCacheConfig | None, req: Request, n: int, start: int) -> int:
    """The tokens a chunk of at most n from `start` computes so that, inside the prompt, it ends where a state is worth
    taking: at the next interval when one falls inside, else at the last multiple of the match unit when the chunk is cut."""
    if pc is None or start >= req.num_prompt_tokens:
        return n
    end = start + n
    if pc.snapshot_interval is not None and (start // pc.snapshot_interval + 1) * pc.snapshot_interval < end:
        return (start // pc.snapshot_interval + 1) * pc.snapshot_interval - start
    aligned = end // pc.match_unit * pc.match_unit
    return aligned - start if n < req.num_tokens - start and aligned > start else n


def snapshot_due(pc: PrefixCacheConfig | None, req: Request) -> bool:
    """Whether the state after req's computed tokens is snapshotted at the end of the step."""
    c = req.num_computed_tokens
    if pc is None or c > req.num_prompt_tokens:
        return False
    interval = pc.snapshot_interval is not None and c % pc.snapshot_interval == 0
    return c == req.num_prompt_tokens or c % pc.match_unit == 0 or c in req.snapshot_points or interval


def cut_points(pc: PrefixCacheConfig | None, req: Request, n: int) -> list[int]:
    """Where a prefill chunk of n tokens from req's computed count takes states inside the step, strictly inside the
    chunk and the prompt, most wanted first: its branch points, then the multiples of the match unit among the deepest
    `prompt_snapshots` below the prompt's end, deepest first."""
    c, end = req.num_computed_tokens, req.num_prompt_tokens
    if pc is None or c >= end:
        return []
    stop = min(c + n, end)
    points = [q for q in req.snapshot_points if c < q < stop]
    if pc.prompt_snapshots:
        u = pc.match_unit
        lowest = max(u, (end - 1) // u * u - (pc.prompt_snapshots - 1) * u)
        points += [q for q in reversed(range(max(lowest, (c // u + 1) * u), stop, u)) if q not in points]
    return points


def reserve_cuts(pc: PrefixCacheConfig | None, scheduled: list[Request], counts: list[int], reserve_slot: Callable[[], int | None]) -> tuple[SnapshotCut, ...]:
    """A snapshot slot (from `reserve_slot`, None when none is left) for each cut point of the step, a request's most wanted
    first, until none is left; the cuts in batch order, ascending (adopted in that order, so the deepest is the most
    recently used)."""
    cuts: list[SnapshotCut] = []
    for i, (req, n) in enumerate(zip(scheduled, counts, strict=True)):
        for q in cut_points(pc, req, n):
            slot = reserve_slot()
            if slot is None:
                return tuple(sorted(cuts))
            cuts.append(SnapshotCut(i, q, slot))
    return tuple(sorted(cuts))
