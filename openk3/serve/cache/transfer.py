"""Copies between cache slots and pages, and the one contiguous buffer a prefix travels in between tiers.

Legend: S state slots, NP pages, PS tokens per page, R latent width, p tokens of the prefix.
A buffer is flat uint8: every KDA layer's recurrent state [H, K, V] fp32, then every conv window [C, W-1], then every MLA
layer's latents of the prefix's p tokens [p, R] (per token, so a buffer does not depend on the page size). One copy moves a
prefix's pages and its KDA snapshot together, which is what makes a tier hit all-or-nothing.
With decode context parallelism (CacheTensors.latent_shards = W) a rank's pages hold its interleaved share, PS / W rows per
page, and its buffer the first ceil(p / W) rows of that share: what rank 0 holds, and the same size on every rank (a rank
holding fewer packs one row it never reads, and unpacks it past the rows it reads).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from openk3.model.batch import CacheTensors, CopyEntry, MirrorLoad, MirrorOp, TierLoad


class MirrorStore(Protocol):
    """Where a rank holding shards repeats rank 0's host tier ops (tier_mirror.TierMirror)."""

    def apply(self, tensors: CacheTensors, op: MirrorOp) -> None: ...


COPY_SLOT, COPY_PAGE = 1, 2  # the kinds of CacheTensors.copy_log entries


def copy_slot(tensors: CacheTensors, src: int, dst: int) -> int:
    """Copy one sequence's KDA state and conv windows; returns the bytes copied."""
    if tensors.copy_log is not None:
        tensors.copy_log.append((COPY_SLOT, src, dst))
    moved = 0
    with torch.no_grad():
        for pool in (*tensors.kda_state, *tensors.conv_state):
            pool[dst].copy_(pool[src])
            moved += pool[src].numel() * pool.element_size()
    return moved


def copy_page(tensors: CacheTensors, src: int, dst: int) -> int:
    """Copy one MLA page in every MLA layer (copy-on-write of a partly filled page); returns the bytes copied."""
    if tensors.copy_log is not None:
        tensors.copy_log.append((COPY_PAGE, src, dst))
    moved = 0
    with torch.no_grad():
        for pool in tensors.mla_latent:
            pool[dst].copy_(pool[src])
            moved += pool[src].numel() * pool.element_size()
    return moved


def _token_rows(page_ids: Sequence[int], num_rows: int, rows_per_page: int, device: torch.device) -> torch.Tensor:
    """Row of each of the first num_rows rows of the pages in a pool viewed as [NP * rows_per_page, R]."""
    pos = torch.arange(num_rows, device=device)
    pages = torch.tensor(list(page_ids), dtype=torch.int64, device=device)
    return pages[pos // rows_per_page] * rows_per_page + pos % rows_per_page


def latent_rows_of(tensors: CacheTensors, num_tokens: int) -> tuple[int, int]:
    """(rows a buffer carries for the first num_tokens positions, rows per page) of these pools: the tokens themselves, or
    with decode context parallelism the first ceil(num_tokens / W) rows of the share (module docstring)."""
    shards = tensors.latent_shards
    return -(-num_tokens // shards), tensors.page_size // shards


def buffer_nbytes(tensors: CacheTensors, num_tokens: int) -> int:
    state = sum(p[0].numel() * p.element_size() for p in (*tensors.kda_state, *tensors.conv_state))
    latent = sum(p.shape[-1] * p.element_size() for p in tensors.mla_latent)
    return state + latent_rows_of(tensors, num_tokens)[0] * latent


def pack(tensors: CacheTensors, slot: int, page_ids: Sequence[int], num_tokens: int) -> torch.Tensor:
    """The prefix's snapshot (slot) and its first num_tokens latents (page_ids) as one contiguous host buffer."""
    parts = [pool[slot].reshape(-1).contiguous().view(torch.uint8) for pool in (*tensors.kda_state, *tensors.conv_state)]
    if tensors.mla_latent:
        rows = _token_rows(page_ids, *latent_rows_of(tensors, num_tokens), tensors.mla_latent[0].device)
        for pool in tensors.mla_latent:
            flat = pool.view(-1, pool.shape[-1])
            parts.append(flat.index_select(0, rows).reshape(-1).contiguous().view(torch.uint8))
    with torch.no_grad():
        return torch.cat(parts).to("cpu")


def replay(tensors: CacheTensors, copies: Sequence[CopyEntry], mirror: MirrorStore | None = None) -> None:
    """Apply another rank's copy log to these pools, in order; its mirror ops (a rank holding shards) on `mirror`."""
    for entry in copies:
        if isinstance(entry, TierLoad):
            unpack(entry.buffer, tensors, entry.slot, entry.page_ids, entry.num_tokens)
            continue
        if isinstance(entry, MirrorOp):
            if mirror is None:
                raise ValueError(f"replay: a tier mirror op ({type(entry).__name__}) for pools without a tier mirror")
            mirror.apply(tensors, entry)
            continue
        kind, src, dst = entry
        if kind == COPY_SLOT:
            copy_slot(tensors, src, dst)
        elif kind == COPY_PAGE:
            copy_page(tensors, src, dst)
        else:
            raise ValueError(f"replay: unknown copy kind {kind} (expected {COPY_SLOT} slot or {COPY_PAGE} page)")


def unpack(buffer: torch.Tensor, tensors: CacheTensors, slot: int, page_ids: Sequence[int], num_tokens: int, key: bytes | None = None) -> None:
    """Write a buffer made by `pack` into a slot and pages (which must cover num_tokens positions). `key`: the host tier
    entry it came from, which ranks holding shards of these pools load from their own mirror (tier_mirror.py)."""
    if tensors.copy_log is not None and not tensors.mirrors_replicate and key is None:
        # a buffer from outside the host tier holds this rank's pools only; the other ranks' shards were never stored
        raise RuntimeError("unpack: a load into pools whose mirrors hold shards of their own, from no host tier entry they mirror")
    expected = buffer_nbytes(tensors, num_tokens)
    if buffer.numel() != expected:
        raise ValueError(f"prefix buffer has {buffer.numel()} bytes; {num_tokens} tokens need {expected}")
    off = 0
    with torch.no_grad():
        for pool in (*tensors.kda_state, *tensors.conv_state):
            n = pool[slot].numel() * pool.element_size()
            pool[slot].copy_(buffer[off : off + n].to(pool.device).view(pool.dtype).view(pool[slot].shape))
            off += n
        if tensors.mla_latent:
            num_rows, per_page = latent_rows_of(tensors, num_tokens)
            rows = _token_rows(page_ids, num_rows, per_page, tensors.mla_latent[0].device)
            for pool in tensors.mla_latent:
                width = pool.shape[-1]
                n = num_rows * width * pool.element_size()
                data = buffer[off : off + n].to(pool.device).view(pool.dtype).view(num_rows, width)
                pool.view(-1, width).index_copy_(0, rows, data)
                off += n
    if tensors.copy_log is not None:  # replicas replay the same load (driver.py sends the buffer), shards their own entry
        pages = tuple(int(p) for p in page_ids)
        if tensors.mirrors_replicate:
            tensors.copy_log.append(TierLoad(buffer, slot, pages, num_tokens))
        else:
            assert key is not None  # checked on entry
            tensors.copy_log.append(MirrorLoad(key, slot, pages, num_tokens))
