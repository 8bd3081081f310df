"""MoonEP planner, vectorised: a per-batch plan that gives every rank the same number of token slots (entries).

Legend: R ranks, E experts, epn = E / R home experts per rank (contiguous: rank r is home of r*epn .. r*epn+epn-1),
B prefetch slots per rank, N = T * k routing entries of one rank, CAP = ceil(all entries / R) slots per rank.

1. tpe[R, E]: entries per (source rank, expert), all-gathered, so every rank computes the same plan with no further talk.
2. balance[h] = entries routed to h's home experts - CAP.
3. Greedy shedding: the most overloaded home h fills the roomiest destination u completely (z[h, u] = -balance[u]).
   Each destination is filled once, so it receives remote entries from one home only, hence at most epn remote experts.
4. Each home splits its quotas over its experts: largest quota first, from the expert with the most entries left.
5. Each destination keeps its top-B remote experts (by entries, then lowest id) as prefetch targets; with B >= epn that is all
   of them. Segments beyond B (only when a byte budget makes B < epn) go back to their home rank: `spilled` counts them and
   that home then exceeds CAP.
6. Grouped-GEMM layout per rank: home experts in order, then prefetch slots in prefetch order, each segment padded to `pad`
   rows, inside a buffer of `buffer_slots` = CAP + (epn + B) * (pad - 1) rows, a bound that depends only on the shapes.
7. Entries: expert e's entries are numbered globally in source-rank order; entry g of e goes to the first rank d with
   cumsum(alloc[e])[d] > g, at slot offset[e, d] + (g - entries of e before d). De-duplication of a token's entries that
   share a destination happens in the exchange (openk3.parallel.ep.exchange), which sends such a row once.
8. check_plan verifies conservation per expert, capacity, prefetch coverage and the layout bound.
moonep_ref.py is the same planner written as plain loops; tests compare the two on random and adversarial loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass(frozen=True)
class MoonPlan:
    capacity: int  # CAP: entry slots per rank
    experts_per_rank: int  # epn
    prefetch_slots: int  # B
    pad: int  # segment padding of the grouped layout
    alloc_ER: torch.Tensor  # [E, R] int64: entries of expert e computed on rank r
    prefetch_ptr: torch.Tensor  # [R + 1] int64: rank r prefetches prefetch_experts[ptr[r]:ptr[r + 1]]
    prefetch_experts: torch.Tensor  # [n] int64, per rank by entries (descending) then expert id (ascending)
    spilled: int  # entries sent back home because their destination had no free prefetch slot
    group_ER: torch.Tensor  # [E, R]: compute-set index of e on r (home: e - r*epn, prefetched: epn + position); read where alloc > 0
    offset_ER: torch.Tensor  # [E, R]: first slot of e's segment in r's grouped buffer; read where alloc > 0
    used_slots_R: torch.Tensor  # [R]: padded slots each rank fills
    buffer_slots: int  # rows of the grouped buffer every rank allocates

    @property
    def num_ranks(self) -> int:
        return self.alloc_ER.shape[1]

    def prefetch_of(self, rank: int) -> torch.Tensor:
        return self.prefetch_experts[int(self.prefetch_ptr[rank]) : int(self.prefetch_ptr[rank + 1])]

    def load_R(self) -> torch.Tensor:
        return self.alloc_ER.sum(0)


class EntryRoute(NamedTuple):
    dest_N: torch.Tensor  # destination rank of each entry
    group_N: torch.Tensor  # compute-set index on that rank (home expert or prefetch slot)
    slot_N: torch.Tensor  # row in that rank's grouped buffer


def check_shapes(tpe_RE: torch.Tensor, experts_per_rank: int, prefetch_slots: int, pad: int) -> None:
    if tpe_RE.dim() != 2 or tpe_RE.shape[1] != tpe_RE.shape[0] * experts_per_rank:
        raise ValueError(f"moonep plan: tokens_per_expert shape {tuple(tpe_RE.shape)}, expected [R, R * {experts_per_rank}]")
    if prefetch_slots < 0 or pad < 1:
        raise ValueError(f"moonep plan: prefetch_slots={prefetch_slots} (expected >= 0), pad={pad} (expected >= 1)")
    if bool((tpe_RE < 0).any()):
        raise ValueError("moonep plan: tokens_per_expert has negative counts")


def shed_quotas(home_load_R: torch.Tensor, capacity: int) -> torch.Tensor:
    """z[h, u]: entries home h sends to rank u (steps 2-3)."""
    balance = home_load_R.clone() - capacity
    z = torch.zeros(balance.shape[0], balance.shape[0], dtype=torch.int64)
    while True:
        h, u = int(torch.argmax(balance)), int(torch.argmin(balance))
        if int(balance[h]) <= 0:
            return z
        move = -int(balance[u])
        z[h, u] = move
        balance[h] -= move
        balance[u] = 0


def split_quotas(count_E: torch.Tensor, z_RR: torch.Tensor, experts_per_rank: int) -> torch.Tensor:
    """alloc[E, R] (step 4), every home at once: each round serves each home's largest quota from its fullest expert."""
    num_ranks = z_RR.shape[0]
    homes = torch.arange(num_ranks)
    remaining = count_E.view(num_ranks, experts_per_rank).clone()
    quota = z_RR.clone()
    alloc = torch.zeros(count_E.shape[0], num_ranks, dtype=torch.int64)
    alloc[torch.arange(count_E.shape[0]), torch.arange(count_E.shape[0]) // experts_per_rank] = count_E
    while True:
        d = torch.argmax(quota, 1)
        q = quota[homes, d]
        active = q > 0
        if not bool(active.any()):
            return alloc
        local = torch.argmax(remaining, 1)
        take = torch.minimum(remaining[homes, local], q) * active
        if bool((active & (take == 0)).any()):
            raise RuntimeError("moonep plan: a home has quota left but no entries (shedding invariant broken)")
        e = homes * experts_per_rank + local
        alloc[e, d] += take
        alloc[e, homes] -= take
        remaining[homes, local] -= take
        quota[homes, d] -= take


def choose_prefetch(alloc_ER: torch.Tensor, experts_per_rank: int, prefetch_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Keep each rank's top-B remote segments (step 5), send the rest home.

    Returns (alloc, keep [E, R], by_rank [min(B, E), R] the candidate experts of each rank in prefetch order, spilled)."""
    num_experts, num_ranks = alloc_ER.shape
    home = torch.arange(num_experts) // experts_per_rank
    remote = (alloc_ER > 0) & (home.unsqueeze(1) != torch.arange(num_ranks))
    # Descending by entries, ties to the lower expert id: one integer key per segment; non-remote rows sort last.
    key = torch.where(remote, alloc_ER * num_experts + (num_experts - 1 - torch.arange(num_experts)).unsqueeze(1), -1)
    order = torch.sort(key, dim=0, descending=True, stable=True).indices
    position = torch.empty_like(order)
    position.scatter_(0, order, torch.arange(num_experts).unsqueeze(1).expand(-1, num_ranks).contiguous())
    keep = remote & (position < prefetch_slots)
    spill = remote & ~keep
    alloc = alloc_ER.clone()
    back = torch.where(spill, alloc, 0)
    alloc -= back
    alloc[torch.arange(num_experts), home] += back.sum(1)
    return alloc, keep, order[: min(prefetch_slots, num_experts)], int(back.sum())


def layout(alloc_ER: torch.Tensor, keep_ER: torch.Tensor, by_rank_BR: torch.Tensor, experts_per_rank: int, pad: int) -> tuple[torch.Tensor, ...]:
    """Step 6 for all ranks at once: (prefetch_ptr, prefetch_experts, group_ER, offset_ER, used_slots_R)."""
    num_experts, num_ranks = alloc_ER.shape
    ranks = torch.arange(num_ranks)
    kept_BR = keep_ER.gather(0, by_rank_BR)  # candidates that were kept are a prefix of each column
    home_experts_RJ = ranks.unsqueeze(1) * experts_per_rank + torch.arange(experts_per_rank)
    experts_RG = torch.cat([home_experts_RJ, by_rank_BR.t()], 1)  # [R, epn + B]: group g of rank r runs this expert
    member_RG = torch.cat([torch.ones_like(home_experts_RJ, dtype=torch.bool), kept_BR.t()], 1)
    counts_RG = torch.where(member_RG, alloc_ER[experts_RG, ranks.unsqueeze(1)], 0)
    padded_RG = (counts_RG + pad - 1) // pad * pad
    ends_RG = torch.cumsum(padded_RG, 1)
    group = torch.zeros_like(alloc_ER)
    offset = torch.zeros_like(alloc_ER)
    r_idx = ranks.unsqueeze(1).expand_as(experts_RG)[member_RG]
    e_idx = experts_RG[member_RG]
    group[e_idx, r_idx] = torch.arange(experts_RG.shape[1]).expand_as(experts_RG)[member_RG]
    offset[e_idx, r_idx] = (ends_RG - padded_RG)[member_RG]
    ptr = torch.zeros(num_ranks + 1, dtype=torch.int64)
    ptr[1:] = torch.cumsum(kept_BR.sum(0), 0)
    return ptr, by_rank_BR.t()[kept_BR.t()], group, offset, ends_RG[:, -1]


def plan_moonep(tpe_RE: torch.Tensor, experts_per_rank: int, prefetch_slots: int, pad: int = 1) -> MoonPlan:
    check_shapes(tpe_RE, experts_per_rank, prefetch_slots, pad)
    tpe = tpe_RE.long().cpu()
    num_ranks = tpe.shape[0]
    count_E = tpe.sum(0)
    capacity = -(-int(count_E.sum()) // num_ranks)
    z = shed_quotas(count_E.view(num_ranks, experts_per_rank).sum(1), capacity)
    alloc, keep, by_rank, spilled = choose_prefetch(split_quotas(count_E, z, experts_per_rank), experts_per_rank, prefetch_slots)
    ptr, experts, group, offset, used = layout(alloc, keep, by_rank, experts_per_rank, pad)
    bound = capacity + (experts_per_rank + prefetch_slots) * (pad - 1)
    return MoonPlan(capacity, experts_per_rank, prefetch_slots, pad, alloc, ptr, experts, spilled, group, offset, used, max(bound, int(used.max())))


def assign_entries(plan: MoonPlan, tpe_RE: torch.Tensor, rank: int, topk_idx: torch.Tensor) -> EntryRoute:
    """Destination, compute-set group and buffer slot of each of this rank's entries (flattened topk_idx), step 7."""
    flat = topk_idx.reshape(-1).long().cpu()
    counts = torch.bincount(flat, minlength=plan.alloc_ER.shape[0])
    order = torch.sort(flat, stable=True).indices
    occurrence = torch.empty_like(flat)
    occurrence[order] = torch.arange(flat.numel()) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    g = tpe_RE.long().cpu()[:rank].sum(0)[flat] + occurrence
    cum = plan.alloc_ER.cumsum(1)
    dest = torch.searchsorted(cum[flat], g.unsqueeze(1), right=True).squeeze(1)
    start = cum[flat, dest] - plan.alloc_ER[flat, dest]
    return EntryRoute(dest, plan.group_ER[flat, dest], plan.offset_ER[flat, dest] + g - start)


def check_plan(plan: MoonPlan, tpe_RE: torch.Tensor) -> None:
    """Raise RuntimeError naming the broken property: conservation, capacity, prefetch coverage or layout bound."""
    count_E = tpe_RE.long().cpu().sum(0)
    alloc = plan.alloc_ER
    epn = plan.experts_per_rank
    if bool((alloc < 0).any()):
        raise RuntimeError("moonep plan: negative allocation")
    if not torch.equal(alloc.sum(1), count_E):
        bad = (alloc.sum(1) != count_E).nonzero().squeeze(1).tolist()
        raise RuntimeError(f"moonep plan: entries not conserved for experts {bad[:8]}")
    if plan.spilled == 0 and bool((plan.load_R() > plan.capacity).any()):
        raise RuntimeError(f"moonep plan: rank loads {plan.load_R().tolist()} exceed capacity {plan.capacity}")
    home = torch.arange(alloc.shape[0]) // epn
    for r in range(plan.num_ranks):
        remote = ((alloc[:, r] > 0) & (home != r)).nonzero().squeeze(1)
        listed = plan.prefetch_of(r)
        if listed.shape[0] > plan.prefetch_slots or set(remote.tolist()) != set(listed.tolist()):
            raise RuntimeError(f"moonep plan: rank {r} runs remote experts {remote.tolist()} but prefetches {listed.tolist()}")
    if int(plan.used_slots_R.max()) > plan.buffer_slots:
        raise RuntimeError(f"moonep plan: layout uses {int(plan.used_slots_R.max())} slots, buffer has {plan.buffer_slots}")
