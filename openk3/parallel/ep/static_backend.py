"""Expert-parallel backend for the MoE seam: plain EP (contiguous experts) or a static placement with replicas (EPLB).

Legend: T tokens of this rank, k experts per token, D expert input width, W ranks, P physical experts per rank.

Two exchanges: exact (exchange.py; counts all-to-all, one payload all-to-all, combine; one host read of the counts) or,
with a Capacity, fixed-capacity (padded.py; one all-to-all each way, no host read, entries beyond capacity dropped).

Every rank runs the same layer on its own tokens (attention data-parallel) and holds only its P physical experts per layer.
Routing entries go logical -> physical through the layer's Placement, then to rank physical // P, compute-set slot
physical % P, through the de-duplicating exchange. All ranks must call the backend for the same layers in the same order,
with T = 0 allowed on a rank that has no tokens this step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from openk3.model.moe import LatentMoE
from openk3.ops.moe.bank import ExpertBank
from openk3.ops.moe.router import RouterOutput
from openk3.parallel.ep.comm import Tally
from openk3.parallel.ep.exchange import Traffic, dispatch_combine, grouped_by_group
from openk3.parallel.ep.padded import Capacity, dispatch_combine_padded, grouped_fixed
from openk3.parallel.ep.placement import LoadCollector, Placement, contiguous_placement, counts_per_id, eplb_placement
from openk3.parallel.ep.rebalance import LiveRebalance
from openk3.parallel.ep.shard import ExpertShard
from openk3.parallel.ep.stats import EPStats, max_over_mean, maxvio
from openk3.parallel.group import ParallelContext


def record_stats(
    ctx: ParallelContext,
    layer_index: int,
    method: str,
    topk_idx: torch.Tensor,
    num_experts: int,
    traffic: Traffic,
    tally: Tally,
    prefetch: int = 0,
    spilled: int = 0,
    plan_s: float = 0.0,
    dropped: int = 0,
) -> EPStats:
    """One all-gather of [E + 2] counts per layer: global tokens per expert, and entries and rows received per rank.

    The tally's figures are taken before this gather, so EPStats counts the exchange's own collectives only."""
    collectives, host_reads = tally.collectives, tally.host_reads
    local = counts_per_id(topk_idx.reshape(-1).to(ctx.device), num_experts)
    mine = torch.cat([local, torch.tensor([traffic.recv_entries, traffic.recv_rows], device=ctx.device)])
    every = ctx.all_gather(mine).cpu()
    entries = every[:, num_experts]
    return EPStats(
        layer_index,
        method,
        tuple(entries.tolist()),
        tuple(every[:, num_experts + 1].tolist()),
        max_over_mean(entries),
        maxvio(every[:, :num_experts].sum(0)),
        traffic.bytes_sent,
        prefetch,
        spilled,
        traffic.comm_s,
        plan_s,
        collectives,
        host_reads,
        dropped,
    )


def gather_placements(ctx: ParallelContext, collector: LoadCollector, layers: Iterable[int], num_redundant: int) -> dict[int, Placement]:
    """EPLB placements from every rank's collected load (summed across ranks), identical on all ranks; all ranks must call."""
    out = {}
    for layer in layers:
        load = ctx.all_gather(collector.load(layer).to(ctx.device)).cpu().sum(0)
        out[layer] = eplb_placement(load, ctx.world_size, num_redundant)
    return out


class ExpertParallelBackend:
    """An ExpertBackend over `ctx`: shards[layer] holds this rank's physical experts of that layer, in placement order."""

    def __init__(
        self,
        ctx: ParallelContext,
        shards: Mapping[int, ExpertShard],
        placements: Mapping[int, Placement],
        collect_stats: bool = True,
        collector: LoadCollector | None = None,
        capacity: Capacity | None = None,
        rebalance: LiveRebalance | None = None,
    ) -> None:
        for layer, placement in placements.items():
            if placement.num_ranks != ctx.world_size:
                raise ValueError(f"EP backend: layer {layer} placement has {placement.num_ranks} ranks, world_size is {ctx.world_size}")
            if layer not in shards or shards[layer].bank.num_experts != placement.slots_per_rank:
                raise ValueError(f"EP backend: layer {layer} needs a shard of {placement.slots_per_rank} experts on rank {ctx.rank}")
        self.ctx, self.shards, self.placements = ctx, dict(shards), dict(placements)
        self.method = "ep" if all(p.slots_per_rank * p.num_ranks == p.num_experts for p in placements.values()) else "eplb"
        self.collect_stats, self.collector, self.capacity = collect_stats, collector, capacity
        self.rebalance = rebalance  # EPLB while serving: re-places a layer every N calls (rebalance.py)
        self._stats: list[EPStats] = []
        self._on_device: dict[tuple[int, torch.device], Placement] = {}

    @classmethod
    def from_layers(
        cls,
        ctx: ParallelContext,
        layers: Iterable[LatentMoE],
        placements: Mapping[int, Placement] | None = None,
        collect_stats: bool = True,
        collector: LoadCollector | None = None,
        capacity: Capacity | None = None,
    ) -> ExpertParallelBackend:
        """Shards cut from each layer's full bank; contiguous placement (plain EP) for layers without a given placement."""
        banks = {layer.layer_index: layer.experts.bank() for layer in layers}
        return cls.from_banks(ctx, banks, placements, collect_stats, collector, capacity)

    @classmethod
    def from_banks(
        cls,
        ctx: ParallelContext,
        banks: Mapping[int, ExpertBank],
        placements: Mapping[int, Placement] | None = None,
        collect_stats: bool = True,
        collector: LoadCollector | None = None,
        capacity: Capacity | None = None,
    ) -> ExpertParallelBackend:
        given = placements or {}
        chosen = {i: given[i] if i in given else contiguous_placement(b.num_experts, ctx.world_size) for i, b in banks.items()}
        shards = {i: ExpertShard.from_bank(b, chosen[i].phys_to_log[ctx.rank]) for i, b in banks.items()}
        return cls(ctx, shards, chosen, collect_stats, collector, capacity)

    def placement_on(self, index: int, device: torch.device) -> Placement:
        """The layer's tables on `device`, copied once, so routing needs no host round trip."""
        key = (index, device)
        if key not in self._on_device:
            self._on_device[key] = self.placements[index].to(device)
        return self._on_device[key]

    def forget_device_copies(self, index: int) -> None:
        """Drop the layer's placement tables copied to devices (its placement changed)."""
        for key in [k for k in self._on_device if k[0] == index]:
            del self._on_device[key]

    def __call__(self, layer: LatentMoE, z_TD: torch.Tensor, routing: RouterOutput) -> torch.Tensor:
        index = layer.layer_index
        if index not in self.placements:
            raise KeyError(f"EP backend: no expert shard for MoE layer {index} (have {sorted(self.placements)})")
        if self.rebalance is not None:
            self.rebalance.before_call(self, index)  # may move this layer's experts first (all ranks, same call)
            self.rebalance.observe(index, routing.topk_idx)
        shard, tally = self.shards[index], Tally(self.ctx)
        placement = self.placement_on(index, routing.topk_idx.device)
        if self.collector is not None:
            self.collector.observe(index, routing.topk_idx)
        physical = placement.route(routing.topk_idx, salt=self.ctx.rank).reshape(-1)
        weight = routing.topk_weight.reshape(-1)
        per = placement.slots_per_rank
        dropped = 0
        if self.capacity is None:
            y32, traffic = dispatch_combine(
                tally, z_TD, physical // per, physical % per, weight, per, lambda got: grouped_by_group(got, shard.bank, layer.expert_act)
            )
        else:
            if z_TD.shape[0] > self.capacity.max_tokens:
                raise ValueError(f"EP backend: {z_TD.shape[0]} tokens in one call, the fixed capacity allows max_tokens={self.capacity.max_tokens}")
            k = routing.topk_idx.shape[1]
            slots = self.capacity.slots(k, placement.num_ranks * per)
            y32, padded = dispatch_combine_padded(
                tally, z_TD, physical, weight, k, per, slots, lambda rows, w: grouped_fixed(rows, w, shard.bank, layer.expert_act)
            )
            if self.collect_stats:
                # Statistics cost host reads anyway; the padded exchange itself never reads these back.
                entries, dropped = torch.stack([padded.recv_entries, padded.dropped]).tolist()
                traffic = Traffic(entries, entries, padded.bytes_sent, padded.comm_s)
        if self.collect_stats:
            self._stats.append(record_stats(self.ctx, index, self.method, routing.topk_idx, placement.num_experts, traffic, tally, dropped=dropped))
        return y32.to(z_TD.dtype)

    def drain_stats(self) -> list[EPStats]:
        out, self._stats = self._stats, []
        return out
