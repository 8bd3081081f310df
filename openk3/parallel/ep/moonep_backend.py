"""MoonEP backend for the MoE seam: plan per layer and step, prefetch remote experts, run the fixed grouped layout.

Legend: T tokens of this rank, k experts per token, E experts, W ranks, epn = E / W home experts per rank, B prefetch
slots, B' = min(B, E), G = epn + B' compute-set groups, X bytes per expert on the wire, CAP entry slots per rank.

Per call: all-gather tokens-per-expert [W, E] (the only data-dependent collective before dispatch), plan on every rank
(identical input, identical plan) on the device, send each prefetched expert from its home to its destination
(all_to_all_single of raw bytes: packed MXFP4 codes and scales when the bank is packed), then dispatch with slots fixed by
the plan. Every rank computes at most CAP entries (more only on a home that takes spilled entries back), in a buffer of
its planned slots, which never exceeds moonep.buffer_bound whatever the routing skew.
Five collectives (count gather, prefetch, then the exchange's three) and two host reads per call, both because
torch's all_to_all_single takes its split sizes as host integers: (1) after planning, one copy of this rank's prefetch
split sizes, its grouped layout (segment starts and counts, which the grouped GEMM loops over on the host) and the spill
count (LayerCounts); (2) the exchange's counts (exchange.py). Removing them needs a device-initiated exchange
(NVSHMEM-style kernels, as MoonEP's own). The plan, the per-entry routes and the slot check run on the device without a host read.
The prefetch budget caps B at budget // X; below epn that may spill entries home (EPStats.spilled).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch

from openk3.model.moe import LatentMoE
from openk3.ops.moe.bank import ExpertBank
from openk3.ops.moe.router import RouterOutput
from openk3.parallel.ep.comm import Tally
from openk3.parallel.ep.exchange import Received, dispatch_combine, grouped_in_slots
from openk3.parallel.ep.moonep import MoonPlan, assign_entries, plan_moonep
from openk3.parallel.ep.placement import LoadCollector, counts_per_id
from openk3.parallel.ep.shard import ExpertShard, SlotBank
from openk3.parallel.ep.static_backend import record_stats
from openk3.parallel.ep.stats import EPStats
from openk3.parallel.group import ParallelContext


class LayerCounts(NamedTuple):
    """The backend's one host read per call: the integers that torch's collectives and the grouped GEMM take on the host."""

    send_W: list[int]  # experts this rank sends to each rank's prefetch slots
    recv_W: list[int]  # experts each home sends into this rank's prefetch slots (its list, grouped by home)
    starts_G: list[int]  # this rank's grouped layout: first slot of each group (home experts, then its prefetch list)
    counts_G: list[int]  # entries of each group
    used_slots: int  # rows of this rank's grouped buffer
    spilled: int  # for EPStats


def listed_WB(plan: MoonPlan) -> torch.Tensor:
    """[W, B'] bool: the entries of the prefetch table that are on a rank's list (the rest is padding)."""
    width = plan.prefetch_RB.shape[1]
    return torch.arange(width, device=plan.prefetch_RB.device) < plan.prefetch_count_R.unsqueeze(1)


def read_counts(tally: Tally, plan: MoonPlan, rank: int) -> LayerCounts:
    world, epn = plan.num_ranks, plan.experts_per_rank
    listed, home_WB = listed_WB(plan), plan.prefetch_RB // epn
    send = (listed & (home_WB == rank)).sum(1)
    homes = torch.arange(world, device=home_WB.device).unsqueeze(1)
    recv = ((home_WB[rank] == homes) & listed[rank]).sum(1)
    mine = [send, recv, plan.group_start_RG[rank], plan.group_count_RG[rank], plan.used_slots_R[rank : rank + 1], plan.spilled.view(1)]
    host = tally.to_host(torch.cat(mine)).tolist()
    width = plan.group_start_RG.shape[1]
    send_W, recv_W = host[:world], host[world : 2 * world]
    starts, counts = host[2 * world : 2 * world + width], host[2 * world + width : 2 * world + 2 * width]
    # Groups past epn + this rank's list are empty prefetch slots: the compute set ends with its list.
    groups = epn + sum(recv_W)
    return LayerCounts(send_W, recv_W, starts[:groups], counts[:groups], host[-2], host[-1])


def prefetch(tally: Tally, plan: MoonPlan, shard: ExpertShard, counts: LayerCounts) -> tuple[SlotBank, int]:
    """This rank's compute set (home experts, then its prefetch list) and the bytes it sent to other ranks' slots."""
    ctx = tally.ctx
    epn, me = plan.experts_per_rank, ctx.rank
    # Each home sends, per destination, the destination's list restricted to its own experts, in list order: the
    # row-major order of the table. How many is known on the host, so a stable sort brings them to the front (a boolean
    # selection would read its size back).
    ours = (listed_WB(plan) & (plan.prefetch_RB // epn == me)).reshape(-1)
    num_send = sum(counts.send_W)
    picked = torch.sort(ours.to(torch.uint8), descending=True, stable=True).indices[:num_send]
    send = shard.to_bytes(plan.prefetch_RB.reshape(-1)[picked] - me * epn) if num_send else torch.zeros(0, shard.expert_nbytes, dtype=torch.uint8)
    got = tally.all_to_all(send.to(ctx.device), counts.send_W, counts.recv_W)
    # Received grouped by home; put them back in prefetch-list order (a stable sort of the list by home is that grouping).
    mine = plan.prefetch_RB[me, : sum(counts.recv_W)]
    by_home = torch.sort(mine // epn, stable=True).indices
    ordered = torch.empty_like(got)
    ordered[by_home.to(got.device)] = got
    prefetched = shard.from_bytes(ordered) if mine.shape[0] else None
    return SlotBank(shard.bank, prefetched), int(send.numel())


class MoonEPBackend:
    """An ExpertBackend over `ctx` whose shards hold the contiguous home experts (E / W per rank) of each layer."""

    def __init__(
        self,
        ctx: ParallelContext,
        shards: Mapping[int, ExpertShard],
        prefetch_budget_bytes: int | None = None,
        pad: int = 1,
        collect_stats: bool = True,
        collector: LoadCollector | None = None,
    ) -> None:
        if prefetch_budget_bytes is not None and prefetch_budget_bytes < 0:
            raise ValueError(f"MoonEP backend: prefetch_budget_bytes={prefetch_budget_bytes}, expected >= 0 or None (no cap)")
        self.ctx, self.shards, self.budget, self.pad, self.collect_stats = ctx, dict(shards), prefetch_budget_bytes, pad, collect_stats
        self.collector = collector
        self._stats: list[EPStats] = []
        self.last_plan: dict[int, MoonPlan] = {}

    @classmethod
    def from_layers(
        cls,
        ctx: ParallelContext,
        layers: Iterable[LatentMoE],
        prefetch_budget_bytes: int | None = None,
        pad: int = 1,
        collect_stats: bool = True,
        collector: LoadCollector | None = None,
    ) -> MoonEPBackend:
        banks = {layer.layer_index: layer.experts.bank() for layer in layers}
        return cls.from_banks(ctx, banks, prefetch_budget_bytes, pad, collect_stats, collector)

    @classmethod
    def from_banks(
        cls,
        ctx: ParallelContext,
        banks: Mapping[int, ExpertBank],
        prefetch_budget_bytes: int | None = None,
        pad: int = 1,
        collect_stats: bool = True,
        collector: LoadCollector | None = None,
    ) -> MoonEPBackend:
        shards = {}
        for i, bank in banks.items():
            if bank.num_experts % ctx.world_size:
                raise ValueError(f"MoonEP backend: layer {i} has {bank.num_experts} experts, not a multiple of world_size={ctx.world_size}")
            epn = bank.num_experts // ctx.world_size
            shards[i] = ExpertShard.from_bank(bank, torch.arange(ctx.rank * epn, (ctx.rank + 1) * epn))
        return cls(ctx, shards, prefetch_budget_bytes, pad, collect_stats, collector)

    def prefetch_slots(self, shard: ExpertShard) -> int:
        epn = shard.bank.num_experts
        if self.budget is None or shard.expert_nbytes == 0:
            return epn
        return min(epn, self.budget // shard.expert_nbytes)

    def __call__(self, layer: LatentMoE, z_TD: torch.Tensor, routing: RouterOutput) -> torch.Tensor:
        index = layer.layer_index
        if index not in self.shards:
            raise KeyError(f"MoonEP backend: no expert shard for MoE layer {index} (have {sorted(self.shards)})")
        shard, ctx, tally = self.shards[index], self.ctx, Tally(self.ctx)
        epn = shard.bank.num_experts
        num_experts = epn * ctx.world_size
        if self.collector is not None:
            self.collector.observe(index, routing.topk_idx)
        t0 = time.perf_counter()
        topk = routing.topk_idx.to(ctx.device)
        every = tally.all_gather(counts_per_id(topk.reshape(-1), num_experts))
        plan = plan_moonep(every, epn, self.prefetch_slots(shard), self.pad)
        counts = read_counts(tally, plan, ctx.rank)
        bank, prefetch_bytes = prefetch(tally, plan, shard, counts)
        plan_s = time.perf_counter() - t0
        self.last_plan[index] = plan
        route = assign_entries(plan, every, ctx.rank, topk)
        expected = sum(counts.counts_G)

        def compute(got: Received) -> torch.Tensor:
            if got.slot_n is None or got.slot_n.shape[0] != expected:
                raise RuntimeError(f"MoonEP: rank {ctx.rank} received {got.row_n.shape[0]} entries for {expected} planned slots")
            # Two entries in one slot would silently overwrite each other's row; checked on the device, so nothing waits.
            fill = torch.zeros(counts.used_slots, dtype=torch.int64, device=got.slot_n.device).index_add_(0, got.slot_n, torch.ones_like(got.slot_n))
            torch._assert_async((fill <= 1).all(), f"MoonEP: rank {ctx.rank} received two entries for one planned slot")
            return grouped_in_slots(got, bank, layer.expert_act, counts.starts_G, counts.counts_G, counts.used_slots)

        y32, traffic = dispatch_combine(tally, z_TD, route.dest_N, route.group_N, routing.topk_weight.reshape(-1), 0, compute, route.slot_N)
        if self.collect_stats:
            self._stats.append(record_stats(ctx, index, "moonep", topk, num_experts, traffic, tally, prefetch_bytes, counts.spilled, plan_s))
        return y32.to(z_TD.dtype)

    def drain_stats(self) -> list[EPStats]:
        out, self._stats = self._stats, []
        return out
