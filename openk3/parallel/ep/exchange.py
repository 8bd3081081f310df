"""Dispatch and combine with per-destination de-duplication, and the local grouped compute on received rows.

Legend: T tokens of this rank, D row width, W ranks, G compute-set groups per rank, N routing entries of this rank (token,
expert pairs), Q unique (token, destination) pairs sent by this rank, M rows received, n entries received.

A token routed to several experts on one rank travels once: the row goes with the list of its entries there (expert slot
in the destination's compute set and routing weight). The destination applies the weights and sums per row, so the combine
also returns one row per (token, destination), and the source only adds its rows back into [T, D].

Collectives per call: three. (1) counts [W, 2 + G] int64 (rows, entries, entries per group) in one equal-split all-to-all;
(2) one payload all-to-all of bytes (wire.py), segment w = everything this rank sends to rank w:
  meta   [n_w, 2 or 3] int64: row index inside the segment, compute-set group, and the grouped-buffer slot when the backend
         fixed one (MoonEP)
  weight [n_w] fp32
  rows   [q_w, D] x dtype, sorted by token
(fields ordered by element size, so the receiver views them without copies); (3) the combine, one all-to-all of [M, D].
One host read: all_to_all_single takes split sizes as host integers, so the exchanged counts are copied to the host once,
and the per-group counts needed by the local compute ride along in the same read. The fixed-capacity exchange (padded.py)
has no host read at all, at the price of padding and dropping entries beyond capacity.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from openk3.ops.moe.bank import ExpertBank
from openk3.ops.moe.naive import Act, expert_forward
from openk3.parallel.ep.comm import Tally
from openk3.parallel.ep.wire import field_of, pack, segment_bytes, unpack


class Received(NamedTuple):
    rows_MD: torch.Tensor
    row_n: torch.Tensor  # received row of each received entry
    group_n: torch.Tensor
    weight_n: torch.Tensor  # fp32
    slot_n: torch.Tensor | None
    group_counts: list[int]  # entries received per compute-set group, summed over sources (host integers)


class Traffic(NamedTuple):
    recv_entries: int
    recv_rows: int
    bytes_sent: int
    comm_s: float


LocalCompute = Callable[[Received], torch.Tensor]  # -> fp32 [M, D], the weighted sum per received row


def _by_element_size(named: dict[str, torch.Tensor]) -> list[str]:
    return sorted(named, key=lambda name: -named[name].element_size())


def dispatch_combine(
    tally: Tally,
    x_TD: torch.Tensor,
    dest_N: torch.Tensor,
    group_N: torch.Tensor,
    weight_N: torch.Tensor,
    num_groups: int,
    compute: LocalCompute,
    slot_N: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Traffic]:
    """y [T, D] fp32 = sum over entries of weight * expert(x[token]); entries are the flattened [T, k] routing (token = i // k).

    num_groups: G, the compute-set size on every rank (0 when the local compute does not need per-group counts)."""
    num_tokens, width = x_TD.shape
    ctx, dev = tally.ctx, x_TD.device
    world = ctx.world_size
    dest_N, group_N = dest_N.to(dev).long(), group_N.to(dev).long()
    num_entries = dest_N.shape[0]
    k = num_entries // num_tokens if num_tokens else 1
    token_N = torch.arange(num_entries, device=dev) // k
    # (destination, token) pairs marked in a [W * T] table: fixed shapes, so nothing here needs a data-dependent size.
    key_N = dest_N * num_tokens + token_N
    present = torch.zeros(world * num_tokens, dtype=torch.bool, device=dev)
    present[key_N] = True
    pair_index = torch.cumsum(present, 0) - 1
    ones = torch.ones(num_entries, dtype=torch.int64, device=dev)
    send_rows = present.view(world, num_tokens).sum(1)
    send_entries = torch.zeros(world, dtype=torch.int64, device=dev).index_add_(0, dest_N, ones)
    send_groups = torch.zeros(world * num_groups, dtype=torch.int64, device=dev)
    if num_groups:
        send_groups.index_add_(0, dest_N * num_groups + group_N, ones)
    counts_send = torch.cat([send_rows.unsqueeze(1), send_entries.unsqueeze(1), send_groups.view(world, num_groups)], 1)

    t0 = time.perf_counter()
    counts_recv = tally.all_to_all_even(counts_send.to(ctx.device))
    # The one host read of this exchange: all_to_all_single needs its split sizes as host integers.
    host = tally.to_host(torch.stack([counts_send, counts_recv.to(dev)]))
    comm = time.perf_counter() - t0
    rows_out, entries_out = host[0, :, 0].tolist(), host[0, :, 1].tolist()
    rows_in, entries_in = host[1, :, 0].tolist(), host[1, :, 1].tolist()

    order = torch.sort(dest_N, stable=True).indices
    pair_start = torch.cumsum(send_rows, 0) - send_rows
    cols = [pair_index[key_N[order]] - pair_start[dest_N[order]], group_N[order]]
    if slot_N is not None:
        cols.append(slot_N.to(dev).long()[order])
    # The set pairs in ascending key order, i.e. by destination then token; Q is known on the host now.
    pair_key = torch.sort(present.to(torch.uint8), descending=True, stable=True).indices[: sum(rows_out)]
    pair_token = pair_key % max(num_tokens, 1)
    fields = {"meta": torch.stack(cols, 1), "weight": weight_N.to(dev).float()[order], "rows": x_TD.index_select(0, pair_token)}
    names = _by_element_size(fields)
    per_rank_out = {"meta": entries_out, "weight": entries_out, "rows": rows_out}
    per_rank_in = {"meta": entries_in, "weight": entries_in, "rows": rows_in}
    payload = pack([fields[n] for n in names], [per_rank_out[n] for n in names])
    kinds = [field_of(fields[n]) for n in names]

    t0 = time.perf_counter()
    got = tally.all_to_all(
        payload.to(ctx.device), segment_bytes(kinds, [per_rank_out[n] for n in names]), segment_bytes(kinds, [per_rank_in[n] for n in names])
    )
    comm += time.perf_counter() - t0
    parts = dict(zip(names, unpack(got.to(dev), kinds, [per_rank_in[n] for n in names]), strict=True))

    meta = torch.cat(parts["meta"])
    row_start = torch.cumsum(host[1, :, 0], 0) - host[1, :, 0]
    row_offset = torch.repeat_interleave(row_start.to(dev), host[1, :, 1].to(dev), output_size=sum(entries_in))
    received = Received(
        torch.cat(parts["rows"]),
        meta[:, 0] + row_offset,
        meta[:, 1],
        torch.cat(parts["weight"]),
        meta[:, 2] if slot_N is not None else None,
        host[1, :, 2:].sum(0).tolist(),
    )
    y_rows = compute(received)

    t0 = time.perf_counter()
    back = tally.all_to_all(y_rows.to(x_TD.dtype).to(ctx.device), rows_in, rows_out)
    comm += time.perf_counter() - t0
    y32 = torch.zeros((num_tokens, width), dtype=torch.float32, device=dev)
    y32.index_put_((pair_token,), back.to(dev).float(), accumulate=True)
    sent = counts_send.numel() * 8 + payload.numel() + back.numel() * back.element_size()
    return y32, Traffic(sum(entries_in), sum(rows_in), sent, comm)


def grouped_by_group(got: Received, bank: ExpertBank, act: Act) -> torch.Tensor:
    """Sort received entries by compute-set group, one matmul per group, weighted sum per received row (fp32)."""
    rows = got.rows_MD
    order = torch.sort(got.group_n, stable=True).indices
    row_sorted = got.row_n[order]
    x = rows.index_select(0, row_sorted)
    w = got.weight_n.index_select(0, order).float()
    y32 = torch.zeros(rows.shape, dtype=torch.float32, device=rows.device)
    start = 0
    for g, count in enumerate(got.group_counts):
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
    slot = got.slot_n
    buffer = rows.new_zeros((buffer_slots, rows.shape[1]))
    row_of_slot = torch.zeros(buffer_slots, dtype=torch.int64, device=rows.device)
    weight_of_slot = torch.zeros(buffer_slots, dtype=torch.float32, device=rows.device)
    row = got.row_n
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
