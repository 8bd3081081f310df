"""MoonEP planner, vectorised, on the tensors' device: a per-batch plan that gives every rank the same number of token slots.

Legend: R ranks, E experts, epn = E / R home experts per rank (contiguous: rank r is home of r*epn .. r*epn+epn-1),
B prefetch slots per rank, B' = min(B, E) columns of the prefetch table, G = epn + B' compute-set groups per rank,
N = T * k routing entries of one rank, M a bound on every rank's N, CAP = ceil(all entries / R) slots per rank.

Nothing here reads a tensor back to the host and every shape follows from R, E, B and N alone: the loops run a fixed
number of steps (a step with nothing left to do changes nothing), lists are fixed-width tables with counts, CAP and
`spilled` stay 0-dim tensors. The plan therefore costs no host synchronisation (and could be captured in a CUDA graph);
the caller reads back only the few integers that torch's collectives need as host values.

1. tpe[R, E]: entries per (source rank, expert), all-gathered, so every rank computes the same plan with no further talk.
2. balance[h] = entries routed to h's home experts - CAP.
3. Greedy shedding: the most overloaded home h fills the roomiest destination u completely (z[h, u] = -balance[u]).
   Each destination is filled once, so it receives remote entries from one home only, hence at most epn remote experts.
4. Each home splits its quotas over its experts: largest quota first, from the expert with the most entries left.
5. Each destination keeps its top-B remote experts (by entries, then lowest id) as prefetch targets; with B >= epn that is all
   of them. Segments beyond B (only when a byte budget makes B < epn) go back to their home rank: `spilled` counts them and
   that home then exceeds CAP.
6. Grouped-GEMM layout per rank: home experts in order, then prefetch slots in prefetch order, each segment padded to `pad`
   rows; `buffer_bound` is a buffer size that fits every rank's layout and depends only on the configuration.
7. Entries: expert e's entries are numbered globally in source-rank order; entry g of e goes to the first rank d with
   cumsum(alloc[e])[d] > g, at slot offset[e, d] + (g - entries of e before d). De-duplication of a token's entries that
   share a destination happens in the exchange (openk3.parallel.ep.exchange), which sends such a row once.
8. check_plan verifies conservation per expert, capacity, prefetch coverage and the layout bound (on the host: a test tool).
moonep_ref.py is the same planner written as plain loops; tests compare the two on random and adversarial loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from openk3.parallel.ep.placement import first_of_sorted

UNUSED = -1  # fills prefetch_RB past a rank's list; prefetch_count_R says where each list ends, so it is never read as an id


@dataclass(frozen=True)
class MoonPlan:
    experts_per_rank: int  # epn
    prefetch_slots: int  # B
    pad: int  # segment padding of the grouped layout
    capacity: torch.Tensor  # 0-dim int64: CAP, entry slots per rank
    alloc_ER: torch.Tensor  # [E, R] int64: entries of expert e computed on rank r
    prefetch_RB: torch.Tensor  # [R, B'] int64: rank r's prefetch list (by entries descending, then expert id), then UNUSED
    prefetch_count_R: torch.Tensor  # [R] int64: length of each rank's prefetch list
    spilled: torch.Tensor  # 0-dim int64: entries sent back home because their destination had no free prefetch slot
    group_ER: torch.Tensor  # [E, R]: compute-set index of e on r (home: e - r*epn, prefetched: epn + position); read where alloc > 0
    offset_ER: torch.Tensor  # [E, R]: first slot of e's segment in r's grouped buffer; read where alloc > 0
    group_start_RG: torch.Tensor  # [R, G]: first slot of group g on rank r (the grouped GEMM's segment starts)
    group_count_RG: torch.Tensor  # [R, G]: entries of group g on rank r, 0 for prefetch slots past the list
    used_slots_R: torch.Tensor  # [R]: padded slots each rank fills

    @property
    def num_ranks(self) -> int:
        return self.alloc_ER.shape[1]

    def prefetch_of(self, rank: int) -> torch.Tensor:
        """Rank `rank`'s prefetch list; reads its length back to the host, so for tests and reports, not the serving path."""
        return self.prefetch_RB[rank, : int(self.prefetch_count_R[rank])]

    def load_R(self) -> torch.Tensor:
        return self.alloc_ER.sum(0)


class EntryRoute(NamedTuple):
    dest_N: torch.Tensor  # destination rank of each entry
    group_N: torch.Tensor  # compute-set index on that rank (home expert or prefetch slot)
    slot_N: torch.Tensor  # row in that rank's grouped buffer


def check_shapes(tpe_RE: torch.Tensor, experts_per_rank: int, prefetch_slots: int, pad: int) -> None:
    """Shapes and settings only: a check of the counts' values would read them back (check_plan does that)."""
    if tpe_RE.dim() != 2 or tpe_RE.shape[1] != tpe_RE.shape[0] * experts_per_rank:
        raise ValueError(f"moonep plan: tokens_per_expert shape {tuple(tpe_RE.shape)}, expected [R, R * {experts_per_rank}]")
    if prefetch_slots < 0 or pad < 1:
        raise ValueError(f"moonep plan: prefetch_slots={prefetch_slots} (expected >= 0), pad={pad} (expected >= 1)")


def buffer_bound(num_ranks: int, experts_per_rank: int, prefetch_slots: int, pad: int, max_entries: int) -> int:
    """Rows of a grouped buffer that holds any rank's layout for any routing in which no rank has more than max_entries
    entries: it depends on the configuration only, so a caller with a fixed token budget can allocate it once.

    With B >= epn nothing spills (step 3) and a rank computes at most CAP <= max_entries entries, since all entries are at
    most R * max_entries. With fewer slots a home takes its spilled entries back and can then hold every entry of the
    batch (B = 0, all tokens to one home): R * max_entries. Padding adds at most pad - 1 rows to each of the G groups."""
    load = max_entries if prefetch_slots >= experts_per_rank else num_ranks * max_entries
    groups = experts_per_rank + min(prefetch_slots, num_ranks * experts_per_rank)
    return load + groups * (pad - 1)


def shed_quotas(home_load_R: torch.Tensor, capacity: torch.Tensor) -> torch.Tensor:
    """z[h, u]: entries home h sends to rank u (steps 2-3), in R - 1 steps.

    R - 1 steps suffice. The balances sum to all entries - R * CAP <= 0, so a step that finds some balance > 0 also finds
    the minimum < 0 and sets it to 0. Only the two picked ranks change, and a rank at 0 is never picked again (h needs a
    balance > 0, u is the minimum, < 0 whenever a step acts), so each acting step removes one rank from the nonzero
    balances for good. An acting step needs two of them (h and u) out of at most R, hence at most R - 1 such steps; every
    other step moves 0."""
    num_ranks = home_load_R.shape[0]
    balance = home_load_R - capacity
    z = torch.zeros(num_ranks, num_ranks, dtype=torch.int64, device=home_load_R.device)
    for _ in range(num_ranks - 1):
        # [1]-shaped picks, never 0-dim ones: indexing with a 0-dim tensor reads it back to the host.
        h, u = torch.argmax(balance, 0, keepdim=True), torch.argmin(balance, 0, keepdim=True)
        move = torch.where(balance.gather(0, h) > 0, -balance.gather(0, u), 0)
        z.index_put_((h, u), move, accumulate=True)
        balance.scatter_add_(0, h, -move).scatter_add_(0, u, move)
    return z


def split_quotas(count_E: torch.Tensor, z_RR: torch.Tensor, experts_per_rank: int) -> torch.Tensor:
    """alloc[E, R] (step 4), every home at once, in epn + R - 1 rounds: each serves each home's largest quota from its fullest expert.

    epn + R - 1 rounds suffice. A home sheds only while what it still holds exceeds CAP, and a move is at most CAP (the
    roomiest rank's room), so its quotas sum to less than its entries; each take lowers both by the same amount, so while a quota is left the fullest expert
    still has entries and the take is > 0. A take empties the quota it serves or the expert it takes from, and neither
    refills: at most epn experts plus R - 1 quotas (never one to itself) per home. A home with no quota left serves its
    largest quota, 0, so its take is 0."""
    num_ranks = z_RR.shape[0]
    dev = z_RR.device
    homes = torch.arange(num_ranks, device=dev)
    first_expert = (homes * experts_per_rank).unsqueeze(1)
    experts = torch.arange(count_E.shape[0], device=dev)
    remaining = count_E.view(num_ranks, experts_per_rank).clone()
    quota = z_RR.clone()
    alloc = torch.zeros(count_E.shape[0], num_ranks, dtype=torch.int64, device=dev)
    alloc[experts, experts // experts_per_rank] = count_E
    for _ in range(experts_per_rank + num_ranks - 1):
        d, local = torch.argmax(quota, 1, keepdim=True), torch.argmax(remaining, 1, keepdim=True)  # [R, 1] each
        take = torch.minimum(remaining.gather(1, local), quota.gather(1, d))
        gone = -take
        alloc.index_put_((first_expert + local, d), take, accumulate=True)
        alloc.index_put_((first_expert + local, homes.unsqueeze(1)), gone, accumulate=True)
        remaining.scatter_add_(1, local, gone)
        quota.scatter_add_(1, d, gone)
    return alloc


def choose_prefetch(alloc_ER: torch.Tensor, experts_per_rank: int, prefetch_slots: int) -> tuple[torch.Tensor, ...]:
    """Keep each rank's top-B remote segments (step 5), send the rest home.

    Returns (alloc, keep [E, R], by_rank [B', R] the candidate experts of each rank in prefetch order, spilled 0-dim)."""
    num_experts, num_ranks = alloc_ER.shape
    dev = alloc_ER.device
    expert_ids = torch.arange(num_experts, device=dev)
    home = expert_ids // experts_per_rank
    remote = (alloc_ER > 0) & (home.unsqueeze(1) != torch.arange(num_ranks, device=dev))
    # Descending by entries, ties to the lower expert id: one integer key per segment; non-remote rows sort last.
    key = torch.where(remote, alloc_ER * num_experts + (num_experts - 1 - expert_ids).unsqueeze(1), -1)
    order = torch.sort(key, dim=0, descending=True, stable=True).indices
    position = torch.empty_like(order)
    position.scatter_(0, order, expert_ids.unsqueeze(1).expand(-1, num_ranks).contiguous())
    keep = remote & (position < prefetch_slots)
    back = torch.where(remote & ~keep, alloc_ER, 0)
    alloc = alloc_ER - back
    alloc[expert_ids, home] += back.sum(1)
    return alloc, keep, order[: min(prefetch_slots, num_experts)], back.sum()


class Layout(NamedTuple):  # the MoonPlan fields of the same names
    prefetch_RB: torch.Tensor
    prefetch_count_R: torch.Tensor
    group_ER: torch.Tensor
    offset_ER: torch.Tensor
    group_start_RG: torch.Tensor
    group_count_RG: torch.Tensor
    used_slots_R: torch.Tensor


def layout(alloc_ER: torch.Tensor, keep_ER: torch.Tensor, by_rank_BR: torch.Tensor, experts_per_rank: int, pad: int) -> Layout:
    """Step 6 for all ranks at once: the prefetch table, the group tables and their scatter to [E, R]."""
    num_experts, num_ranks = alloc_ER.shape
    dev = alloc_ER.device
    ranks = torch.arange(num_ranks, device=dev).unsqueeze(1)
    kept_BR = keep_ER.gather(0, by_rank_BR)  # candidates that were kept are a prefix of each column
    home_experts_RJ = ranks * experts_per_rank + torch.arange(experts_per_rank, device=dev)
    experts_RG = torch.cat([home_experts_RJ, by_rank_BR.t()], 1)  # group g of rank r runs this expert, where a member
    member_RG = torch.cat([torch.ones_like(home_experts_RJ, dtype=torch.bool), kept_BR.t()], 1)
    counts_RG = torch.where(member_RG, alloc_ER[experts_RG, ranks], 0)
    padded_RG = (counts_RG + pad - 1) // pad * pad
    ends_RG = torch.cumsum(padded_RG, 1)
    # Members scatter their group and offset to (expert, rank); the others write to a spare row E that is dropped, which
    # keeps the shapes fixed (a boolean selection would size its result from the data).
    row_RG = torch.where(member_RG, experts_RG, num_experts)
    col_RG = ranks.expand_as(experts_RG)
    group = torch.zeros(num_experts + 1, num_ranks, dtype=torch.int64, device=dev)
    group.index_put_((row_RG, col_RG), torch.arange(experts_RG.shape[1], device=dev).expand_as(experts_RG))
    offset = torch.zeros_like(group)
    offset.index_put_((row_RG, col_RG), ends_RG - padded_RG)
    prefetch_RB = torch.where(kept_BR.t(), by_rank_BR.t(), UNUSED)
    return Layout(prefetch_RB, kept_BR.sum(0), group[:num_experts], offset[:num_experts], ends_RG - padded_RG, counts_RG, ends_RG[:, -1])


def plan_moonep(tpe_RE: torch.Tensor, experts_per_rank: int, prefetch_slots: int, pad: int = 1) -> MoonPlan:
    check_shapes(tpe_RE, experts_per_rank, prefetch_slots, pad)
    tpe = tpe_RE.long()
    num_ranks = tpe.shape[0]
    count_E = tpe.sum(0)
    capacity = (count_E.sum() + num_ranks - 1) // num_ranks
    z = shed_quotas(count_E.view(num_ranks, experts_per_rank).sum(1), capacity)
    alloc, keep, by_rank, spilled = choose_prefetch(split_quotas(count_E, z, experts_per_rank), experts_per_rank, prefetch_slots)
    tables = layout(alloc, keep, by_rank, experts_per_rank, pad)
    return MoonPlan(experts_per_rank, prefetch_slots, pad, capacity, alloc, spilled=spilled, **tables._asdict())


def assign_entries(plan: MoonPlan, tpe_RE: torch.Tensor, rank: int, topk_idx: torch.Tensor) -> EntryRoute:
    """Destination, compute-set group and buffer slot of each of this rank's entries (flattened topk_idx), step 7.

    On the device of the plan, tpe and topk_idx (all three the same); no host read."""
    flat = topk_idx.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    occurrence = torch.empty_like(flat)
    occurrence[order] = torch.arange(flat.numel(), device=flat.device) - first_of_sorted(flat[order], plan.alloc_ER.shape[0])
    g = tpe_RE.long()[:rank].sum(0)[flat] + occurrence
    cum = plan.alloc_ER.cumsum(1)
    dest = torch.searchsorted(cum[flat], g.unsqueeze(1), right=True).squeeze(1)
    start = cum[flat, dest] - plan.alloc_ER[flat, dest]
    return EntryRoute(dest, plan.group_ER[flat, dest], plan.offset_ER[flat, dest] + g - start)


def check_plan(plan: MoonPlan, tpe_RE: torch.Tensor, max_entries: int | None = None) -> None:
    """Raise naming the broken property: counts, conservation, capacity, prefetch coverage or layout bound.

    Reads the plan back to the host: a tool for tests and offline checks. max_entries: the per-rank bound the layout must
    fit (buffer_bound), by default the largest rank's entries in tpe_RE."""
    tpe = tpe_RE.long().cpu()
    if bool((tpe < 0).any()):
        raise ValueError("moonep plan: tokens_per_expert has negative counts")
    count_E = tpe.sum(0)
    alloc = plan.alloc_ER.cpu()
    epn = plan.experts_per_rank
    if bool((alloc < 0).any()):
        raise RuntimeError("moonep plan: negative allocation")
    if not torch.equal(alloc.sum(1), count_E):
        bad = (alloc.sum(1) != count_E).nonzero().squeeze(1).tolist()
        raise RuntimeError(f"moonep plan: entries not conserved for experts {bad[:8]}")
    load = alloc.sum(0)
    if int(plan.spilled) == 0 and bool((load > int(plan.capacity)).any()):
        raise RuntimeError(f"moonep plan: rank loads {load.tolist()} exceed capacity {int(plan.capacity)}")
    home = torch.arange(alloc.shape[0]) // epn
    for r in range(plan.num_ranks):
        remote = ((alloc[:, r] > 0) & (home != r)).nonzero().squeeze(1)
        listed = plan.prefetch_of(r).cpu()
        if listed.shape[0] > plan.prefetch_slots or set(remote.tolist()) != set(listed.tolist()):
            raise RuntimeError(f"moonep plan: rank {r} runs remote experts {remote.tolist()} but prefetches {listed.tolist()}")
    bound = buffer_bound(plan.num_ranks, epn, plan.prefetch_slots, plan.pad, int(tpe.sum(1).max()) if max_entries is None else max_entries)
    used = int(plan.used_slots_R.max())
    if used > bound:
        raise RuntimeError(f"moonep plan: layout uses {used} slots, buffer_bound is {bound}")
