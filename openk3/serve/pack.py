"""Packing rows into a ForwardBatch, for every forward the engine runs (the runner's step, the draft model's forwards, a
speculative rollback's recompute), and copying one KDA state slot out and back (serve/speculative.py).
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


def pack(rows: list[PackedRow], device: torch.device, logits_rows: list[int] | None = None) -> ForwardBatch:
    """A variable-length ForwardBatch of `rows`, sequences end to end with no padding (every forward the engine runs is
    packed here: the runner's step, the draft's, a rollback's); the logits of `logits_rows` (rows of the packed tokens), or
    by default of the last token of each row that wants them, in row order."""
    ids: list[int] = []
    positions: list[int] = []
    cu, last_rows = [0], []
    for r in rows:
        ids.extend(r.token_ids)
        positions.extend(range(r.start, r.start + len(r.token_ids)))
        cu.append(cu[-1] + len(r.token_ids))
        if r.wants_logits:
            last_rows.append(cu[-1] - 1)
    if logits_rows is None:
        logits_rows = last_rows
    # Entries past a request's own pages are never read (the model only touches pages covering its positions).
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
