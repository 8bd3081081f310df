"""Fixed-capacity dispatch and combine: shapes fixed by the configuration, so no host read and no counts exchange.

Legend: T tokens of this rank (T <= max_tokens), k experts per token, D row width, W ranks, P physical experts per rank,
C slots per (source rank, physical expert), S = W * P * C slots this rank sends, N = T * k routing entries.

The exact exchange (exchange.py) learns the split sizes from the data, which costs a counts all-to-all and one host read
per layer. Here every source gives every physical expert C slots whatever the routing, so every size is known from the
configuration on every rank: one all-to-all for dispatch, one for combine, no device -> host copy, and a step can be
captured in a CUDA graph. The price: no de-duplication (one row per entry), empty slots travel and are computed as zero
rows, and the entries of an expert beyond its C slots on a source (in token order) are dropped: they contribute zero,
as in capacity-factor MoE training. With C = max_tokens nothing can drop (a token names an expert at most once) and the
output equals the exact exchange's.

Wire, per destination w (wire.py; fixed counts, so no header is needed to find the fields):
  kept    [1] int64: entries this source placed for w (a statistic; the slots themselves carry zero weights when empty)
  weight  [P * C] fp32, 0 for an empty slot
  rows    [P * C, D] x dtype, zeros for an empty slot
Combine: [P * C, D] x dtype per destination, each slot already weighted; the source adds slot rows into their tokens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from openk3.ops.moe.bank import ExpertBank
from openk3.ops.moe.naive import Act, expert_forward
from openk3.parallel.ep.comm import Tally
from openk3.parallel.ep.placement import first_of_sorted
from openk3.parallel.ep.wire import field_of, pack, segment_bytes, unpack


@dataclass(frozen=True)
class Capacity:
    """C = min(max_tokens, ceil(factor * max_tokens * k / physical experts)), the same on every rank."""

    factor: float  # slots per expert over the mean load of a full batch; >= physical experts / k never drops
    max_tokens: int  # every rank's bound on tokens per MoE call; all ranks must use the same value

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"Capacity: factor={self.factor}, expected > 0")
        if self.max_tokens < 1:
            raise ValueError(f"Capacity: max_tokens={self.max_tokens}, expected >= 1")

    def slots(self, k: int, num_physical: int) -> int:
        return max(1, min(self.max_tokens, math.ceil(self.factor * self.max_tokens * k / num_physical)))


class PaddedTraffic(NamedTuple):
    recv_entries: torch.Tensor  # scalar int64 on the device: entries this rank computed (not read back unless asked)
    dropped: torch.Tensor  # scalar int64 on the device: this rank's entries beyond capacity
    bytes_sent: int
    comm_s: float


FixedCompute = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # rows [W, P, C, D], weights [W, P, C] -> fp32 [W, P, C, D]


def dispatch_combine_padded(
    tally: Tally,
    x_TD: torch.Tensor,
    physical_N: torch.Tensor,
    weight_N: torch.Tensor,
    k: int,
    slots_per_rank: int,
    capacity_slots: int,
    compute: FixedCompute,
) -> tuple[torch.Tensor, PaddedTraffic]:
    """y [T, D] fp32 = sum over kept entries of weight * expert(x[token]); physical_N: r * P + slot per flattened entry."""
    num_tokens, width = x_TD.shape
    ctx, dev = tally.ctx, x_TD.device
    world, per, cap = ctx.world_size, slots_per_rank, capacity_slots
    total = world * per * cap
    physical = physical_N.to(dev).long()
    order = torch.sort(physical, stable=True).indices
    occurrence = torch.empty_like(physical)
    occurrence[order] = torch.arange(physical.shape[0], device=dev) - first_of_sorted(physical[order], world * per)
    keep = occurrence < cap
    # Dropped entries go to one overflow slot past the end, cut off before sending: fixed shapes, no boolean compaction.
    target = torch.where(keep, physical * cap + occurrence, total)
    token_N = torch.arange(physical.shape[0], device=dev) // max(k, 1)
    weight_S = torch.zeros(total + 1, dtype=torch.float32, device=dev).index_put_((target,), weight_N.to(dev).float())[:total]
    rows_SD = x_TD.new_zeros((total + 1, width)).index_put_((target,), x_TD.index_select(0, token_N))[:total]
    token_S = torch.zeros(total + 1, dtype=torch.int64, device=dev).index_put_((target,), token_N)[:total]
    filled_S = torch.zeros(total + 1, dtype=torch.bool, device=dev).index_put_((target,), keep)[:total]
    kept_W = filled_S.view(world, per * cap).sum(1, keepdim=True)

    named = {"kept": kept_W, "weight": weight_S, "rows": rows_SD}
    names = sorted(named, key=lambda n: -named[n].element_size())  # wire order: descending element size
    counts = [[1] * world if n == "kept" else [per * cap] * world for n in names]
    kinds = [field_of(named[n]) for n in names]
    seg = segment_bytes(kinds, counts)
    payload = pack([named[n] for n in names], counts)
    t0 = time.perf_counter()
    got = tally.all_to_all(payload.to(ctx.device), seg, seg).to(dev)
    comm = time.perf_counter() - t0
    parts = dict(zip(names, unpack(got, kinds, counts), strict=True))
    recv_kept = torch.cat(parts["kept"]).sum()
    rows_in = torch.stack(parts["rows"]).view(world, per, cap, width)
    weight_in = torch.stack(parts["weight"]).view(world, per, cap)
    y_in = compute(rows_in, weight_in)

    t0 = time.perf_counter()
    back = tally.all_to_all(y_in.to(x_TD.dtype).reshape(total, width).to(ctx.device), [per * cap] * world, [per * cap] * world).to(dev)
    comm += time.perf_counter() - t0
    y32 = torch.zeros((num_tokens, width), dtype=torch.float32, device=dev)
    y32.index_add_(0, token_S, back.float() * filled_S.unsqueeze(1))
    dropped = (~keep).sum()
    sent = payload.numel() + back.numel() * back.element_size()
    return y32, PaddedTraffic(recv_kept, dropped, sent, comm)


def grouped_fixed(rows_WPCD: torch.Tensor, weight_WPC: torch.Tensor, bank: ExpertBank, act: Act) -> torch.Tensor:
    """Each local expert g over its W * C slots (empty ones too: fixed shapes), weighted per slot, fp32."""
    world, per, cap, width = rows_WPCD.shape
    out = torch.zeros(rows_WPCD.shape, dtype=torch.float32, device=rows_WPCD.device)
    for g in range(per):
        x = rows_WPCD[:, g].reshape(world * cap, width)
        y = expert_forward(x, bank.expert(g, rows_WPCD.dtype), act, g).float() * weight_WPC[:, g].reshape(-1, 1)
        out[:, g] = y.view(world, cap, width)
    return out
