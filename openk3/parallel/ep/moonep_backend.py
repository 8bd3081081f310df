"""MoonEP backend for the MoE seam: plan per layer and step, prefetch remote experts, run the fixed grouped layout.

Legend: T tokens of this rank, k experts per token, E experts, W ranks, epn = E / W home experts per rank, B prefetch
slots, X bytes per expert on the wire, CAP entry slots per rank.

Per call: all-gather tokens-per-expert [W, E] (the only data-dependent collective before dispatch), plan on every rank
(identical input, identical plan), send each prefetched expert from its home to its destination (all_to_all_single of
raw bytes: packed MXFP4 codes and scales when the bank is packed), then dispatch with slots fixed by the plan. Every rank
computes exactly CAP entries (the plan's load), in a buffer of plan.buffer_slots rows whatever the routing skew.
Five collectives (count gather, prefetch, then the exchange's three) and three host reads (tpe with this rank's routing
for the planner, which is host code; the exchange's counts; the slot check) per call.
The prefetch budget caps B at budget // X; below epn that may spill entries home (EPStats.spilled).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

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


def prefetch(tally: Tally, plan: MoonPlan, shard: ExpertShard) -> tuple[SlotBank, int]:
    """This rank's compute set (home experts, then its prefetch list) and the bytes it sent to other ranks' slots."""
    ctx = tally.ctx
    epn, me = plan.experts_per_rank, ctx.rank
    mine = plan.prefetch_of(me)
    # Each home sends, per destination, the destination's prefetch list restricted to its own experts, in list order.
    outgoing = [plan.prefetch_of(d)[plan.prefetch_of(d) // epn == me] - me * epn for d in range(ctx.world_size)]
    send = shard.to_bytes(torch.cat(outgoing)) if sum(o.numel() for o in outgoing) else torch.zeros(0, shard.expert_nbytes, dtype=torch.uint8)
    recv_counts = [int((mine // epn == h).sum()) for h in range(ctx.world_size)]
    got = tally.all_to_all(send.to(ctx.device), [o.numel() for o in outgoing], recv_counts)
    # Received grouped by home; put them back in prefetch-list order (a stable sort of the list by home is that grouping).
    by_home = torch.sort(mine // epn, stable=True).indices
    ordered = torch.empty_like(got)
    ordered[by_home.to(got.device)] = got
    prefetched = shard.from_bytes(ordered) if mine.numel() else None
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
        local = counts_per_id(routing.topk_idx.reshape(-1).to(ctx.device), num_experts)
        every = tally.all_gather(local)
        # The planner runs on the host, so it needs tpe and this rank's routing there: one read for both.
        both = tally.to_host(torch.cat([every.reshape(-1), routing.topk_idx.reshape(-1).to(ctx.device).long()]))
        tpe, topk = both[: every.numel()].view_as(every), both[every.numel() :].view(routing.topk_idx.shape)
        plan = plan_moonep(tpe, epn, self.prefetch_slots(shard), self.pad)
        bank, prefetch_bytes = prefetch(tally, plan, shard)
        plan_s = time.perf_counter() - t0
        self.last_plan[index] = plan
        route = assign_entries(plan, tpe, ctx.rank, topk)
        experts = torch.cat([torch.arange(ctx.rank * epn, (ctx.rank + 1) * epn), plan.prefetch_of(ctx.rank)])
        starts = plan.offset_ER[experts, ctx.rank].tolist()
        counts = plan.alloc_ER[experts, ctx.rank].tolist()
        expected = int(plan.alloc_ER[:, ctx.rank].sum())

        def compute(got: Received) -> torch.Tensor:
            if got.slot_n is None or got.slot_n.shape[0] != expected:
                raise RuntimeError(f"MoonEP: rank {ctx.rank} received {got.row_n.shape[0]} entries for {expected} planned slots")
            # A validation read: two entries in one slot would silently overwrite each other's row.
            fill = torch.zeros(plan.buffer_slots, dtype=torch.int64, device=got.slot_n.device).index_add_(0, got.slot_n, torch.ones_like(got.slot_n))
            if bool(tally.to_host((fill > 1).any())):
                raise RuntimeError(f"MoonEP: rank {ctx.rank} received two entries for one planned slot")
            return grouped_in_slots(got, bank, layer.expert_act, starts, counts, plan.buffer_slots)

        y32, traffic = dispatch_combine(tally, z_TD, route.dest_N, route.group_N, routing.topk_weight.reshape(-1), 0, compute, route.slot_N)
        if self.collect_stats:
            self._stats.append(record_stats(ctx, index, "moonep", topk, num_experts, traffic, tally, prefetch_bytes, plan.spilled, plan_s))
        return y32.to(z_TD.dtype)

    def drain_stats(self) -> list[EPStats]:
        out, self._stats = self._stats, []
        return out
