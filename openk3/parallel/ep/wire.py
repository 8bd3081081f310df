"""Several typed tensors in one byte buffer per destination, so one all_to_all_single carries them all.

Legend: W ranks, F fields, n_fw items of field f for (or from) rank w, b_f bytes per item of field f.

A field is a tensor of items grouped by destination (rows [Q, D] in the activation dtype, metadata [N, 3] int64, weights [N]
fp32, ...). Segment w of the buffer holds, in field order, the items each field sends to rank w, then zero padding to a
multiple of ALIGN bytes. Fields are ordered by descending element size, so every field starts at a multiple of its own element size
inside a segment, and every segment starts at a multiple of ALIGN: the receiver views its bytes back as typed tensors
without copying (torch refuses a view whose byte offset is not a multiple of the element size).

The receiver must know n_fw of every sender to find the fields: the exact exchange sends those counts first, the padded
one fixes them by shape. Bytes travel as uint8, which gloo and NCCL both carry, whatever dtype the fields have.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

ALIGN = 8


class Field(NamedTuple):
    dtype: torch.dtype
    item_shape: tuple[int, ...]  # one item's shape: (D,) for a row, (3,) for a metadata record, () for a weight

    @property
    def item_bytes(self) -> int:
        return math.prod(self.item_shape) * torch.empty((), dtype=self.dtype).element_size()


def field_of(t: torch.Tensor) -> Field:
    return Field(t.dtype, tuple(t.shape[1:]))


def check_order(fields: Sequence[Field]) -> None:
    sizes = [torch.empty((), dtype=f.dtype).element_size() for f in fields]
    if sizes != sorted(sizes, reverse=True) or (sizes and sizes[0] > ALIGN):
        raise ValueError(f"wire: fields must come by descending element size, at most {ALIGN} bytes; got {sizes}")


def segment_bytes(fields: Sequence[Field], counts_FW: Sequence[Sequence[int]]) -> list[int]:
    """Bytes of each destination's segment, padding included."""
    world = len(counts_FW[0]) if counts_FW else 0
    raw = [sum(counts_FW[f][w] * field.item_bytes for f, field in enumerate(fields)) for w in range(world)]
    return [-(-b // ALIGN) * ALIGN for b in raw]


def pack(tensors: Sequence[torch.Tensor], counts_FW: Sequence[Sequence[int]]) -> torch.Tensor:
    """uint8 [sum of segment bytes]: tensors[f] holds counts_FW[f][w] items for rank w, grouped by destination."""
    fields = [field_of(t) for t in tensors]
    check_order(fields)
    for f, (t, counts) in enumerate(zip(tensors, counts_FW, strict=True)):
        if t.shape[0] != sum(counts):
            raise ValueError(f"wire: field {f} has {t.shape[0]} items, its per-rank counts sum to {sum(counts)}")
    flat = [t.contiguous().view(-1).view(torch.uint8) for t in tensors]
    device = tensors[0].device
    zeros = torch.zeros(ALIGN, dtype=torch.uint8, device=device)
    offsets = [0] * len(tensors)
    pieces = []
    for w, seg in enumerate(segment_bytes(fields, counts_FW)):
        used = 0
        for f, field in enumerate(fields):
            n = counts_FW[f][w] * field.item_bytes
            pieces.append(flat[f][offsets[f] : offsets[f] + n])
            offsets[f] += n
            used += n
        pieces.append(zeros[: seg - used])
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8, device=device)


def unpack(buffer: torch.Tensor, fields: Sequence[Field], counts_FW: Sequence[Sequence[int]]) -> list[list[torch.Tensor]]:
    """[field][source] typed views into `buffer` (no copies); counts_FW[f][w]: items of field f that rank w sent."""
    check_order(fields)
    segments = segment_bytes(fields, counts_FW)
    if sum(segments) != buffer.numel():
        raise ValueError(f"wire: received {buffer.numel()} bytes, the counts describe {sum(segments)}")
    out: list[list[torch.Tensor]] = [[] for _ in fields]
    start = 0
    for w, seg in enumerate(segments):
        at = start
        for f, field in enumerate(fields):
            n = counts_FW[f][w]
            out[f].append(buffer[at : at + n * field.item_bytes].view(field.dtype).view(n, *field.item_shape))
            at += n * field.item_bytes
        start += seg
    return out
