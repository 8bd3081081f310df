"""EPLB while serving: every `interval_steps` calls of a MoE layer, its experts are placed again from the load of the last
`interval_steps` calls (a sliding window, every rank's tokens summed), and the weights move between ranks.

Legend: E logical experts, R ranks, P physical slots per rank, X bytes of one expert on the wire (shard.py).

When: at the start of a layer's call, before its routing is dispatched; every rank calls the backend for the same layers
in the same order (static_backend.py), so every rank reaches the same layer's re-placement at the same point of the
same step with the same window, and no extra synchronisation is needed. The step that triggers it is served by the new
placement; the tokens do not change, only which rank computes which expert's entries.

How: one all-gather of the layer's [E] window counts (identical placements on every rank: eplb_placement is
deterministic), then one all-to-all of expert weights (each new slot gets its expert from the rank itself when its old
slots hold it, else from the lowest rank that does; the split sizes follow from the two placements, which every rank
knows, so no counts are exchanged). The physical slot count per rank never changes: a shard is rebuilt in place of the
old one, of the same size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from openk3.parallel.ep.placement import LoadCollector, Placement, eplb_placement
from openk3.parallel.ep.shard import ExpertShard
from openk3.parallel.group import ParallelContext


@dataclass(frozen=True)
class RebalanceConfig:
    interval_steps: int  # calls of a layer between re-placements, and the window of calls the load is summed over
    num_redundant: int  # physical experts beyond E (fixed: every placement has R * P = E + num_redundant slots)
    min_gain: float = 0.02  # a new placement must lower the window's rank max/mean by this fraction to be worth its weight traffic

    def __post_init__(self) -> None:
        if self.interval_steps < 1:
            raise ValueError(f"RebalanceConfig.interval_steps={self.interval_steps} is invalid: expected an int >= 1")
        if self.num_redundant < 0:
            raise ValueError(f"RebalanceConfig.num_redundant={self.num_redundant} is invalid: expected an int >= 0")
        if not 0 <= self.min_gain < 1:
            raise ValueError(f"RebalanceConfig.min_gain={self.min_gain} is invalid: expected a fraction in [0, 1)")


class Replaced(NamedTuple):
    """One re-placement of one layer: the window's rank load max/mean under the old placement and under the one kept
    (the new one when it is at least min_gain lower, else the old one, kept with nothing moved)."""

    layer_index: int
    call: int  # the layer's call that triggered it (0-based)
    before: float
    after: float
    moved: int  # experts received from another rank, summed over ranks


class Placed(Protocol):
    """What a re-placement changes in an EP backend (static_backend.ExpertParallelBackend)."""

    ctx: ParallelContext
    shards: dict[int, ExpertShard]
    placements: dict[int, Placement]

    def forget_device_copies(self, index: int) -> None: ...


def rank_load(placement: Placement, load_E: torch.Tensor) -> torch.Tensor:
    """[R] float64: the entries each rank computes when each expert's load splits evenly over its replicas."""
    per_replica = load_E.double() / placement.replica_counts().double()
    return per_replica[placement.phys_to_log].sum(1)


def max_over_mean(load_R: torch.Tensor) -> float:
    mean = float(load_R.mean())
    return float(load_R.max()) / mean if mean > 0 else 1.0


def expert_sources(old: Placement, new: Placement) -> torch.Tensor:
    """[R, P] int64: the rank each new slot's expert comes from: the rank itself when it holds that expert now, else the
    lowest rank that does (every expert has a replica in `old`: Placement.from_table checks it)."""
    ranks = old.num_ranks
    holders = [set(old.phys_to_log[r].tolist()) for r in range(ranks)]
    out = torch.empty_like(new.phys_to_log)
    for r in range(ranks):
        for j, e in enumerate(new.phys_to_log[r].tolist()):
            out[r, j] = r if e in holders[r] else next(s for s in range(ranks) if e in holders[s])
    return out


def move_experts(ctx: ParallelContext, shard: ExpertShard, old: Placement, new: Placement) -> tuple[ExpertShard, int]:
    """This rank's shard under `new`, its missing experts received from the ranks `expert_sources` names (one
    all-to-all, every rank calls); and how many experts the whole group moved."""
    rank, sources = ctx.rank, expert_sources(old, new)
    own_slot: dict[int, int] = {}
    for slot, e in enumerate(old.phys_to_log[rank].tolist()):
        own_slot.setdefault(e, slot)
    send: list[int] = []
    send_counts = []
    for d in range(ctx.world_size):
        mine = [own_slot[e] for j, e in enumerate(new.phys_to_log[d].tolist()) if d != rank and int(sources[d, j]) == rank]
        send += mine
        send_counts.append(len(mine))
    recv_counts = [0 if s == rank else int((sources[rank] == s).sum()) for s in range(ctx.world_size)]
    got = ctx.all_to_all(shard.to_bytes(torch.tensor(send, dtype=torch.int64)).to(ctx.device), send_counts, recv_counts).cpu()
    start = [sum(recv_counts[:s]) for s in range(ctx.world_size)]
    rows = []
    for j, e in enumerate(new.phys_to_log[rank].tolist()):
        s = int(sources[rank, j])
        if s == rank:
            rows.append(shard.to_bytes(torch.tensor([own_slot[e]])).cpu()[0])
        else:
            rows.append(got[start[s]])
            start[s] += 1
    data = torch.stack(rows) if rows else torch.empty(0, shard.expert_nbytes, dtype=torch.uint8)
    device = shard.device
    moved = int((sources != torch.arange(ctx.world_size).unsqueeze(1)).sum())
    return ExpertShard(shard.from_bytes(data.to(device)), new.phys_to_log[rank]), moved


class LiveRebalance:
    """The re-placement state of one EP backend: a sliding window of its layers' load, the calls counted per layer, and
    what each re-placement did (`history`). Fed and run by the backend, on the thread that runs the model."""

    def __init__(self, config: RebalanceConfig, num_experts: int) -> None:
        self.config = config
        self.collector = LoadCollector(num_experts, window=config.interval_steps)
        self.calls: dict[int, int] = {}
        self.history: list[Replaced] = []

    def before_call(self, backend: Placed, index: int) -> None:
        """Count this call of layer `index`; every interval_steps-th call (not the first) re-places the layer first."""
        call = self.calls.get(index, 0)
        self.calls[index] = call + 1
        if call == 0 or call % self.config.interval_steps:
            return
        ctx, old = backend.ctx, backend.placements[index]
        load = ctx.all_gather(self.collector.load(index).to(ctx.device)).cpu().sum(0)
        new = eplb_placement(load, ctx.world_size, self.config.num_redundant)
        if new.slots_per_rank != old.slots_per_rank:
            raise ValueError(f"EPLB re-placement: layer {index} would get {new.slots_per_rank} slots per rank, it has {old.slots_per_rank}")
        before, after = max_over_mean(rank_load(old, load)), max_over_mean(rank_load(new, load))
        moved, kept = 0, before
        if after < before * (1 - self.config.min_gain):  # a placement barely better is not worth its weight traffic
            backend.shards[index], moved = move_experts(ctx, backend.shards[index], old, new)
            backend.placements[index] = new
            backend.forget_device_copies(index)
            kept = after
        self.history.append(Replaced(index, call, before, kept, moved))

    def observe(self, index: int, topk_idx: torch.Tensor) -> None:
        self.collector.observe(index, topk_idx)
