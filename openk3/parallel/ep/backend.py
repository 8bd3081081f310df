"""What an engine or trainer calls to run a model expert-parallel: `attach_expert_parallel(model, ctx, method, ...)`.

Legend: T tokens of a step, W ranks, D expert input width, C = ceil(T / W) tokens per rank when attention is replicated.

Two ways to feed the MoE layers, chosen by `replicated_tokens`:
- False (attention data-parallel): every rank runs its own batch; the EP backend sees each rank's own tokens.
- True (attention replicated): every rank runs the same batch (rank 0 schedules and broadcasts it); TokenSplit gives
  rank r rows r*C .. r*C+C-1 to dispatch and all-gathers the outputs, so every rank ends with bitwise the same y and the
  same sampled tokens. This is the least intrusive way to serve with --ep N.
Either way every rank must run the same number of forward passes per step (an idle data-parallel rank runs a dummy batch).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from openk3.model.model import K3ForCausalLM
from openk3.model.moe import LatentMoE
from openk3.ops.moe.router import RouterOutput
from openk3.parallel.config import EPMethod
from openk3.parallel.ep.moonep_backend import MoonEPBackend
from openk3.parallel.ep.padded import Capacity
from openk3.parallel.ep.placement import LoadCollector, Placement
from openk3.parallel.ep.static_backend import ExpertParallelBackend
from openk3.parallel.ep.stats import EPStats
from openk3.parallel.group import ParallelContext

EPBackend = ExpertParallelBackend | MoonEPBackend


class TokenSplit:
    """Wraps an EP backend for replicated attention: each rank dispatches only its C-row share, outputs are all-gathered."""

    def __init__(self, ctx: ParallelContext, inner: EPBackend, collector: LoadCollector | None = None) -> None:
        self.ctx, self.inner, self.collector = ctx, inner, collector

    def __call__(self, layer: LatentMoE, z_TD: torch.Tensor, routing: RouterOutput) -> torch.Tensor:
        if self.collector is not None:
            # The whole batch, before the split: every rank's collector then holds the load of all ranks' tokens.
            self.collector.observe(layer.layer_index, routing.topk_idx)
        num_tokens, world = z_TD.shape[0], self.ctx.world_size
        chunk = -(-num_tokens // world)
        lo, hi = min(num_tokens, self.ctx.rank * chunk), min(num_tokens, (self.ctx.rank + 1) * chunk)
        part = RouterOutput(routing.topk_idx[lo:hi], routing.topk_weight[lo:hi], routing.scores[lo:hi])
        y = self.inner(layer, z_TD[lo:hi], part)
        padded = y.new_zeros((chunk, y.shape[1]))
        padded[: hi - lo] = y
        return self.ctx.all_gather(padded.to(self.ctx.device)).to(z_TD.device).reshape(world * chunk, -1)[:num_tokens]

    def drain_stats(self) -> list[EPStats]:
        return self.inner.drain_stats()


def build_backend(
    ctx: ParallelContext,
    layers: list[LatentMoE],
    method: EPMethod | str,
    placements: Mapping[int, Placement] | None = None,
    prefetch_budget_bytes: int | None = None,
    collect_stats: bool = True,
    collector: LoadCollector | None = None,
    capacity: Capacity | None = None,
) -> EPBackend:
    chosen = EPMethod(method)
    if chosen is EPMethod.EPLB and not placements:
        raise ValueError("expert parallel: method='eplb' needs placements from measured load (load_stats.eplb_engine_placements, gather_placements)")
    if chosen is EPMethod.MOONEP:
        if capacity is not None:
            raise ValueError("expert parallel: method='moonep' plans every batch exactly; a fixed capacity applies to 'ep' and 'eplb'")
        return MoonEPBackend.from_layers(ctx, layers, prefetch_budget_bytes, 1, collect_stats, collector)
    return ExpertParallelBackend.from_layers(ctx, layers, placements if chosen is EPMethod.EPLB else None, collect_stats, collector, capacity)


def attach_expert_parallel(
    model: K3ForCausalLM,
    ctx: ParallelContext,
    method: EPMethod | str = EPMethod.MOONEP,
    replicated_tokens: bool = False,
    placements: Mapping[int, Placement] | None = None,
    prefetch_budget_bytes: int | None = None,
    collect_stats: bool = True,
    collector: LoadCollector | None = None,
    capacity: Capacity | None = None,
) -> EPBackend | TokenSplit:
    """Shard every MoE layer's experts for this rank and attach the backend; returns it (drain_stats() per step).

    The model's own full expert weights stay in place (the shards are copies); a loader that builds per-rank shards can
    construct ExpertParallelBackend / MoonEPBackend from ExpertShards directly instead. collector: with replicated tokens
    it counts the whole batch (TokenSplit), otherwise this rank's tokens (the backend; sum with load_stats.gather_load).
    capacity: the fixed-capacity exchange (padded.py) for ep/eplb; with replicated tokens max_tokens bounds C = ceil(T / W).
    """
    split_collector = collector if replicated_tokens else None
    inner = build_backend(ctx, model.moe_layers(), method, placements, prefetch_budget_bytes, collect_stats, None if replicated_tokens else collector, capacity)
    backend: EPBackend | TokenSplit = TokenSplit(ctx, inner, split_collector) if replicated_tokens else inner
    model.set_expert_backend(backend)
    return backend
