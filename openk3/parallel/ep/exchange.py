"""Dispatch and combine with per-destination de-duplication, and the local grouped compute on received rows.

Legend: T tokens of this rank, D row width, W ranks, N routing entries of this rank (token, expert pairs), Q unique
(token, destination) pairs sent by this rank, M rows received, n entries received.

A token routed to several experts on one rank travels once: the row goes with the list of its entries there (expert slot
in the destination's compute set and routing weight). The destination applies the weights and sums per row, so the combine
also returns one row per (token, destination), and the source only adds its rows back into [T, D].

Wire layout, per destination w (all_to_all_single, counts exchanged first as [W, 2] = rows, entries):
  rows   [Q, D] x dtype, sorted by (destination, token)
  meta   [N, 2 or 3] int64: row index inside that destination's segment, compute-set group, and the grouped-buffer slot
         when the backend fixed one (MoonEP)
  weight [N] fp32
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from openk3.ops.moe.bank import ExpertBank
from openk3.ops.moe.naive import Act, expert_forward
from openk3.parallel.group import ParallelContext


class Received(NamedTuple):
    rows_MD: torch.Tensor
    row_n: torch.Tensor  # received row of each received entry
    group_n: torch.Tensor
    weight_n: torch.Tensor  # fp32
    slot_n: torch.Tensor | None


class Traffic(NamedTuple):
    recv_entries: int
    recv_rows: int
    bytes_sent: int
    comm_s: float


LocalCompute = Callable[[Received], torch.Tensor]  # -> fp32 [M, D], the weighted sum per received row


def dispatch_combine(
    ctx: ParallelContext,
    x_TD: torch.Tensor,
    dest_N: torch.Tensor,
    group_N: torch.Tensor,
    weight_N: torch.Tensor,
    compute: LocalCompute,
    slot_N: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Traffic]:
    """y [T, D] fp32 = sum over entries of weight * expert(x[token]); entries are the flattened [T, k] routing (token = i // k)."""
    num_tokens, width = x_TD.shape
    world = ctx.world_size
    k = dest_N.shape[0] // num_tokens if num_tokens else 0
    token_N = torch.arange(dest_N.shape[0]) // max(k, 1)
    pair_key, pair_of_N = torch.unique(dest_N * num_tokens + token_N, return_inverse=True)
    pair_dest, pair_token = pair_key // max(num_tokens, 1), pair_key % max(num_tokens, 1)
    send_rows = torch.bincount(pair_dest, minlength=world)
    send_entries = torch.bincount(dest_N, minlength=world)
    pair_start = torch.cumsum(send_rows, 0) - send_rows
    order = torch.sort(dest_N, stable=True).indices
    cols = [pair_of_N[order] - pair_start[dest_N[order]], group_N[order]]
    if slot_N is not None:
        cols.append(slot_N[order])
    meta_send = torch.stack(cols, 1) if cols[0].numel() else torch.zeros(0, len(cols), dtype=torch.int64)

    t0 = time.perf_counter()
    recv_counts = ctx.exchange_counts(torch.stack([send_rows, send_entries], 1))
    rows_out, entries_out = send_rows.tolist(), send_entries.tolist()
    rows_in, entries_in = recv_counts[:, 0].tolist(), recv_counts[:, 1].tolist()
    dev = ctx.device
    rows = ctx.all_to_all(x_TD.index_select(0, pair_token.to(x_TD.device)).to(dev), rows_out, rows_in)
    meta = ctx.all_to_all(meta_send.to(dev), entries_out, entries_in).cpu()
    weight = ctx.all_to_all(weight_N.float()[order].to(dev), entries_out, entries_in)
    comm = time.perf_counter() - t0

    row_start = torch.cumsum(recv_counts[:, 0], 0) - recv_counts[:, 0]
    source_n = torch.repeat_interleave(torch.arange(world), recv_counts[:, 1])
    received = Received(rows, meta[:, 0] + row_start[source_n], meta[:, 1], weight, meta[:, 2] if slot_N is not None else None)
    y_rows = compute(received)

    t0 = time.perf_counter()
    back = ctx.all_to_all(y_rows.to(x_TD.dtype), rows_in, rows_out)
    comm += time.perf_counter() - t0
    y32 = torch.zeros((num_tokens, width), dtype=torch.float32, device=x_TD.device)
    y32.index_put_((pair_token.to(x_TD.device),), back.to(x_TD.device).float(), accumulate=True)
    elem = x_TD.element_size()
    sent = int(send_rows.sum()) * width * elem * 2 + meta_send.numel() * 8 + dest_N.shape[0] * 4
    return y32, Traffic(int(recv_counts[:, 1].sum()), rows.shape[0], sent, comm)


def grouped_by_group(got: Received, bank: ExpertBank, act: Act) -> torch.Tensor:
    """Sort received entries by compute-set group, one matmul per group, weighted sum per received row (fp32)."""
    rows = got.rows_MD
    order = torch.sort(got.group_n, stable=True).indices
    row_sorted = got.row_n[order].to(rows.device)
    x = rows.index_select(0, row_sorted)
    w = got.weight_n.index_select(0, order.to(got.weight_n.device)).float()
    y32 = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
    start = 0
    for g, count in enumerate(torch.bincount(got.group_n, minlength=bank.num_experts).tolist()):
        if count == 0:
            continue
        end = start + count
        out = expert_forward(x[start:end], bank.expert(g, rows.dtype), act, g)
        y32.index_put_((row_sorted[start:end],), out.float() * w[start:end].unsqueeze(1), accumulate=True)
        start = end
    return y32


def grouped_in_slots(got: Received, bank: ExpertBank, act: Act, starts_G: list[int], counts_G: list[int], buffer_slots: int) -> torch.Tensor:
    """The fixed grouped-GEMM layout: rows copied into their planned slots (a de-duplicated row fills every slot of its
    entries), group g runs over slots starts[g] .. starts[g] + counts[g]; weighted sum per received row (fp32)."""
    rows = got.rows_MD
    if got.slot_n is None:
        raise ValueError("grouped_in_slots: entries carry no slots")
    slot = got.slot_n.to(rows.device)
    buffer = rows.new_zeros((buffer_slots, rows.shape[1]))
    row_of_slot = torch.zeros(buffer_slots, dtype=torch.int64, device=rows.device)
    weight_of_slot = torch.zeros(buffer_slots, dtype=torch.float32, device=rows.device)
    row = got.row_n.to(rows.device)
    buffer[slot] = rows.index_select(0, row)
    row_of_slot[slot] = row
    weight_of_slot[slot] = got.weight_n.float()
    y32 = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
    for g, (start, count) in enumerate(zip(starts_G, counts_G, strict=True)):
        if count == 0:
            continue
        end = start + count
        out = expert_forward(buffer[start:end], bank.expert(g, rows.dtype), act, g)
        y32.index_put_((row_of_slot[start:end],), out.float() * weight_of_slot[start:end].unsqueeze(1), accumulate=True)
    return y32
