"""MoonEP planner, the definition: the same steps as moonep.py written as plain loops over Python integers.

Legend: R ranks, E experts, epn home experts per rank, B prefetch slots per rank, B' = min(B, E), G = epn + B', CAP slots per rank.
Ties always go to the lowest index (what torch.argmax/argmin do), so this and the vectorised planner agree exactly.
"""

from __future__ import annotations

import torch

from openk3.parallel.ep.moonep import UNUSED, EntryRoute, MoonPlan, check_shapes


def _argmax(values: list[int]) -> int:
    return values.index(max(values))


def plan_reference(tpe_RE: torch.Tensor, experts_per_rank: int, prefetch_slots: int, pad: int = 1) -> MoonPlan:
    check_shapes(tpe_RE, experts_per_rank, prefetch_slots, pad)
    tpe = tpe_RE.long().tolist()
    if min(min(row) for row in tpe) < 0:
        raise ValueError("moonep plan: tokens_per_expert has negative counts")
    num_ranks, num_experts, epn = len(tpe), len(tpe[0]), experts_per_rank
    count = [sum(tpe[s][e] for s in range(num_ranks)) for e in range(num_experts)]
    capacity = -(-sum(count) // num_ranks)
    home = [e // epn for e in range(num_experts)]

    balance = [sum(count[h * epn : (h + 1) * epn]) - capacity for h in range(num_ranks)]
    z = [[0] * num_ranks for _ in range(num_ranks)]
    while True:
        h, u = _argmax(balance), balance.index(min(balance))
        if balance[h] <= 0:
            break
        z[h][u] = -balance[u]
        balance[h] -= z[h][u]
        balance[u] = 0

    alloc = [[0] * num_ranks for _ in range(num_experts)]
    for e in range(num_experts):
        alloc[e][home[e]] = count[e]
    for h in range(num_ranks):
        remaining = count[h * epn : (h + 1) * epn]
        quota = list(z[h])
        while max(quota) > 0:
            d, local = _argmax(quota), _argmax(remaining)
            take = min(remaining[local], quota[d])
            alloc[h * epn + local][d] += take
            alloc[h * epn + local][h] -= take
            remaining[local] -= take
            quota[d] -= take

    spilled = 0
    prefetch: list[list[int]] = []
    for r in range(num_ranks):
        remote = sorted((e for e in range(num_experts) if alloc[e][r] > 0 and home[e] != r), key=lambda e: (-alloc[e][r], e))
        for e in remote[prefetch_slots:]:
            spilled += alloc[e][r]
            alloc[e][home[e]] += alloc[e][r]
            alloc[e][r] = 0
        prefetch.append(remote[:prefetch_slots])

    width = min(prefetch_slots, num_experts)
    groups = epn + width
    group = [[0] * num_ranks for _ in range(num_experts)]
    offset = [[0] * num_ranks for _ in range(num_experts)]
    starts, counts, used = [], [], [0] * num_ranks
    for r in range(num_ranks):
        members = list(range(r * epn, (r + 1) * epn)) + prefetch[r]
        starts.append([0] * groups)
        counts.append([0] * groups)
        for g, e in enumerate(members):
            group[e][r], offset[e][r] = g, used[r]
            starts[r][g], counts[r][g] = used[r], alloc[e][r]
            used[r] += -(-alloc[e][r] // pad) * pad
        for g in range(len(members), groups):
            starts[r][g] = used[r]

    def t(x: list | int) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64)

    table = torch.full((num_ranks, width), UNUSED, dtype=torch.int64)
    for r, p in enumerate(prefetch):
        table[r, : len(p)] = t(p)
    return MoonPlan(
        epn, prefetch_slots, pad, t(capacity), t(alloc), table, t([len(p) for p in prefetch]), t(spilled), t(group), t(offset), t(starts), t(counts), t(used)
    )


def assign_entries_reference(plan: MoonPlan, tpe_RE: torch.Tensor, rank: int, topk_idx: torch.Tensor) -> EntryRoute:
    alloc = plan.alloc_ER.tolist()
    tpe = tpe_RE.long().tolist()
    seen = [sum(tpe[s][e] for s in range(rank)) for e in range(len(alloc))]
    dest, group, slot = [], [], []
    for e in topk_idx.reshape(-1).tolist():
        g = seen[e]
        seen[e] += 1
        d, before = 0, 0
        while g >= before + alloc[e][d]:
            before += alloc[e][d]
            d += 1
        dest.append(d)
        group.append(int(plan.group_ER[e, d]))
        slot.append(int(plan.offset_ER[e, d]) + g - before)
    return EntryRoute(torch.tensor(dest, dtype=torch.int64), torch.tensor(group, dtype=torch.int64), torch.tensor(slot, dtype=torch.int64))
