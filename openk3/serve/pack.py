"""Packing rows into a ForwardBatch outside the runner's step plan, and copying one KDA state slot out and back: what the
draft model's forwards and a speculative rollback (serve/speculative.py) are made of.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openk3.model.batch import ForwardBatch, HostFacts
from openk3.serve.cache.manager import CacheManager


@dataclass(frozen=True)
class PackedRow:
    """One sequence of a packed forward: its slot and pages, the position its tokens start at, and whether its last
    token's logits are wanted."""

    slot: int
    pages: list[int]
    start: int
    token_ids: list[int]
    wants_logits: bool = True


def pack(rows: list[PackedRow], device: torch.device) -> ForwardBatch:
    """A variable-length ForwardBatch of `rows` (the layout ModelRunner.build_batch makes); logits of the last token of
    each row that wants them, in row order."""
    ids: list[int] = []
    positions: list[int] = []
    cu, logits_rows = [0], []
    for r in rows:
        ids.extend(r.token_ids)
        positions.extend(range(r.start, r.start + len(r.token_ids)))
        cu.append(cu[-1] + len(r.token_ids))
        if r.wants_logits:
            logits_rows.append(cu[-1] - 1)
    width = max(len(r.pages) for r in rows)
    table = torch.tensor([r.pages + [0] * (width - len(r.pages)) for r in rows], dtype=torch.int64)
    starts, slots = [r.start for r in rows], [r.slot for r in rows]
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        cu_seqlens=torch.tensor(cu, dtype=torch.int64, device=device),
        context_lens=torch.tensor(starts, dtype=torch.int64, device=device),
        state_slots=torch.tensor(slots, dtype=torch.int64, device=device),
        page_table=table.to(device),
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=device),
        is_decode=all(len(r.token_ids) == 1 for r in rows),
        host_facts=HostFacts.of(starts, slots),
    )


def save_slot(cache: CacheManager, slot: int) -> list[torch.Tensor]:
    """A copy of one slot's KDA states and conv windows (every KDA layer)."""
    t = cache.tensors
    return [pool[slot].clone() for pool in (*t.kda_state, *t.conv_state)]


def restore_slot(cache: CacheManager, slot: int, saved: list[torch.Tensor]) -> None:
    t = cache.tensors
    for pool, s in zip((*t.kda_state, *t.conv_state), saved, strict=True):
        pool[slot].copy_(s)
