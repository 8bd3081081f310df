"""Static expert placement (EPLB-style): replicate hot experts, pack replicas onto ranks, route logical -> physical.

Legend: E logical experts, R ranks, P physical expert slots per rank, R * P physical experts (E + redundant), T tokens,
k experts per token, L the MoE layers a collector watches.

Replication adds one replica at a time to the expert with the largest load per replica (at most R replicas); packing sorts
the replicas by load and puts each into the lightest rank that still has a free slot and does not hold that expert yet, so
every rank holds exactly P experts, and two copies of one expert share a rank only when no other rank has room. A placement is a
table, not a policy: physical expert p = r * P + slot lives on rank r and runs logical expert phys_to_log[r, slot].
Replicas of one expert split its entries in turn (entry i of the expert on a source rank goes to replica (i + rank) % n),
so each replica gets an equal share, within one entry, from every source rank.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    phys_to_log: torch.Tensor  # [R, P] int64: the logical expert each physical slot runs
    replica_ptr: torch.Tensor  # [E + 1] int64: replicas of expert e are replica_phys[replica_ptr[e]:replica_ptr[e + 1]]
    replica_phys: torch.Tensor  # [R * P] int64: physical ids r * P + slot, grouped by logical expert

    @classmethod
    def from_table(cls, phys_to_log: torch.Tensor, num_experts: int) -> Placement:
        flat = phys_to_log.reshape(-1).long()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
            raise ValueError(f"placement: logical ids span {int(flat.min())}..{int(flat.max())}, expected 0..{num_experts - 1}")
        counts = torch.bincount(flat, minlength=num_experts)
        if bool((counts == 0).any()):
            missing = (counts == 0).nonzero().squeeze(1).tolist()
            raise ValueError(f"placement: experts {missing[:8]} have no replica; every logical expert needs at least one")
        ptr = torch.zeros(num_experts + 1, dtype=torch.int64)
        ptr[1:] = counts.cumsum(0)
        return cls(phys_to_log.long(), ptr, torch.sort(flat, stable=True).indices)

    @property
    def num_ranks(self) -> int:
        return self.phys_to_log.shape[0]

    @property
    def slots_per_rank(self) -> int:
        return self.phys_to_log.shape[1]

    @property
    def num_experts(self) -> int:
        return self.replica_ptr.shape[0] - 1

    def replica_counts(self) -> torch.Tensor:
        return self.replica_ptr[1:] - self.replica_ptr[:-1]

    def to(self, device: torch.device) -> Placement:
        """The same tables on `device`, so routing runs where the router ran."""
        return Placement(self.phys_to_log.to(device), self.replica_ptr.to(device), self.replica_phys.to(device))

    def route(self, topk_idx: torch.Tensor, salt: int) -> torch.Tensor:
        """Physical expert per routing entry, [T, k]; `salt` (the source rank) rotates which replica goes first.

        Fixed shapes only (sort, scatter, no bincount, whose output size depends on the data), so on a GPU it runs without a
        host synchronisation when the tables are on the same device (`to`)."""
        flat = topk_idx.reshape(-1).long()
        order = torch.sort(flat, stable=True).indices
        occurrence = torch.empty_like(flat)
        occurrence[order] = torch.arange(flat.numel(), device=flat.device) - first_of_sorted(flat[order], self.num_experts)
        replica = (occurrence + salt) % self.replica_counts()[flat]
        return self.replica_phys[self.replica_ptr[flat] + replica].view(topk_idx.shape)


def counts_per_id(ids_N: torch.Tensor, num_ids: int) -> torch.Tensor:
    """[num_ids] int64 occurrences of each id, on ids' device; torch.bincount would size its output from the data."""
    return torch.zeros(num_ids, dtype=torch.int64, device=ids_N.device).index_add_(0, ids_N.long(), torch.ones_like(ids_N, dtype=torch.int64))


def first_of_sorted(sorted_ids_N: torch.Tensor, num_ids: int) -> torch.Tensor:
    """For each item of an ascending id list, the position where its id's run starts (so position - start = occurrence)."""
    counts = counts_per_id(sorted_ids_N, num_ids)
    return (torch.cumsum(counts, 0) - counts)[sorted_ids_N]


def contiguous_placement(num_experts: int, num_ranks: int) -> Placement:
    """Plain EP: rank r holds experts r * E/R .. (r + 1) * E/R - 1, no replicas."""
    if num_ranks < 1 or num_experts % num_ranks:
        raise ValueError(f"contiguous placement: num_experts={num_experts} must be a multiple of num_ranks={num_ranks}")
    return Placement.from_table(torch.arange(num_experts).view(num_ranks, -1), num_experts)


def replicate(load_E: torch.Tensor, num_physical: int, max_replicas: int | None = None) -> torch.Tensor:
    """Replica count per expert [E]: start at one each, then add one at a time to the largest load per replica among the
    experts below `max_replicas` (a placement over R ranks caps at R: a second copy on one rank balances nothing)."""
    num_experts = load_E.shape[0]
    if num_physical < num_experts:
        raise ValueError(f"replicate: num_physical={num_physical} is below num_experts={num_experts}")
    if max_replicas is not None and num_physical > num_experts * max_replicas:
        raise ValueError(f"replicate: num_physical={num_physical} exceeds num_experts={num_experts} x max_replicas={max_replicas}")
    load = load_E.double()
    counts = torch.ones(num_experts, dtype=torch.int64)
    for _ in range(num_physical - num_experts):
        per_replica = load / counts
        if max_replicas is not None:
            per_replica = torch.where(counts < max_replicas, per_replica, torch.tensor(-1.0, dtype=torch.float64))
        counts[int(torch.argmax(per_replica))] += 1
    return counts


def balanced_pack(weight_N: torch.Tensor, num_packs: int, group_N: torch.Tensor | None = None) -> torch.Tensor:
    """Pack index per item [N], each pack exactly N / num_packs items: heaviest item first into the lightest pack with room.

    group_N (optional): items of one group (replicas of one expert) go to different packs whenever a pack with room
    lacks that group; only when none does may two share a pack."""
    n = weight_N.shape[0]
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"balanced_pack: {n} items do not split evenly into num_packs={num_packs}")
    per_pack = n // num_packs
    pack_load = torch.zeros(num_packs, dtype=torch.float64)
    pack_items = torch.zeros(num_packs, dtype=torch.int64)
    held: list[set[int]] = [set() for _ in range(num_packs)]
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    out = torch.empty(n, dtype=torch.int64)
    for item in torch.sort(weight_N.double(), descending=True, stable=True).indices.tolist():
        room = pack_items < per_pack
        if group_N is not None:
            group = int(group_N[item])
            fresh = room & torch.tensor([group not in h for h in held])
            room = fresh if bool(fresh.any()) else room
        p = int(torch.argmin(torch.where(room, pack_load, inf)))
        out[item] = p
        pack_load[p] += float(weight_N[item])
        pack_items[p] += 1
        if group_N is not None:
            held[p].add(group)
    return out


def eplb_placement(load_E: torch.Tensor, num_ranks: int, num_redundant: int) -> Placement:
    """Replicate by load (at most one replica per rank and expert while the slots allow), then pack the replicas (each
    carrying load / replicas) evenly onto `num_ranks` ranks, replicas of one expert on different ranks."""
    num_experts = load_E.shape[0]
    num_physical = num_experts + num_redundant
    if num_redundant < 0 or num_physical % num_ranks:
        raise ValueError(
            f"eplb placement: num_experts={num_experts} + num_redundant={num_redundant} = {num_physical} physical experts "
            f"must be a multiple of num_ranks={num_ranks} (every rank holds the same count)"
        )
    cap = num_ranks if num_physical <= num_experts * num_ranks else None
    counts = replicate(load_E, num_physical, cap)
    replica_log = torch.repeat_interleave(torch.arange(num_experts), counts)
    replica_load = load_E.double()[replica_log] / counts[replica_log]
    pack = balanced_pack(replica_load, num_ranks, replica_log)
    order = torch.sort(pack, stable=True).indices
    return Placement.from_table(replica_log[order].view(num_ranks, -1), num_experts)


def redundant_for(num_experts: int, num_ranks: int, fraction: float) -> int:
    """The smallest redundant count >= fraction * E that gives every rank the same number of physical experts."""
    want = num_experts + max(0, int(torch.ceil(torch.tensor(fraction * num_experts)).item()))
    return -(-want // num_ranks) * num_ranks - num_experts


class LoadCollector:
    """Tokens per expert per MoE layer over the last `window` observed steps, or (window=None) a running sum since start:
    what an engine exports (`--export-eplb-stats`), one [E] tensor per layer however long it serves. The engine or trainer
    feeds it topk_idx.

    Not thread-safe: the caller feeds it from the one thread that runs the model.
    """

    def __init__(self, num_experts: int, window: int | None) -> None:
        if window is not None and window < 1:
            raise ValueError(f"LoadCollector: window={window}, expected >= 1 steps (or None: every step since start)")
        self.num_experts, self.window = num_experts, window
        self._steps: dict[int, deque[torch.Tensor]] = {}
        self._totals: dict[int, torch.Tensor] = {}  # window=None: [E] int64 on the router's device
        self._counted: dict[int, int] = {}  # window=None: steps observed per layer

    def observe(self, layer_index: int, topk_idx: torch.Tensor) -> None:
        """Counted where the router ran: no host read per layer; load() copies the counts to the host."""
        counts = counts_per_id(topk_idx.reshape(-1), self.num_experts)
        if self.window is not None:
            self._steps.setdefault(layer_index, deque(maxlen=self.window)).append(counts)
            return
        total = self._totals.get(layer_index)
        if total is None:
            self._totals[layer_index] = counts  # a fresh tensor (counts_per_id): the running sum may own it
        else:
            total.add_(counts)
        self._counted[layer_index] = self._counted.get(layer_index, 0) + 1

    def steps(self, layer_index: int) -> int:
        """Steps of `layer_index` the counts cover (inside the window: at most `window`)."""
        if self.window is None:
            return self._counted.get(layer_index, 0)
        return len(self._steps.get(layer_index, ()))

    def layers(self) -> list[int]:
        return sorted(self._totals if self.window is None else self._steps)

    def load(self, layer_index: int) -> torch.Tensor:
        """[E] int64 tokens per expert summed over the window or since start (zeros when the layer was never observed)."""
        if self.window is None:
            total = self._totals.get(layer_index)
            return torch.zeros(self.num_experts, dtype=torch.int64) if total is None else total.cpu().clone()
        steps = self._steps.get(layer_index)
        if not steps:
            return torch.zeros(self.num_experts, dtype=torch.int64)
        return torch.stack(list(steps)).sum(0).cpu()

    def placements(self, num_ranks: int, num_redundant: int) -> dict[int, Placement]:
        return {layer: eplb_placement(self.load(layer), num_ranks, num_redundant) for layer in self.layers()}
