"""One rank's model for expert-parallel serving: the whole trunk (attention, router, shared experts), and only its experts.

Legend: E experts per MoE layer, W ranks, epn = E / W, P physical experts per rank (EPLB: (E + redundant) / W).

Which experts rank r holds, per MoE layer:
- ep, moonep: its home range r*epn .. r*epn+epn-1 (MoonEP fetches the remote experts a step needs into prefetch slots);
- eplb: placement.phys_to_log[r], built at start with 10% redundant replicas from a measured load file (`--eplb-stats
  FILE`, written by a run with `--export-eplb-stats FILE`; `engine_placements` -> load_stats.eplb_engine_placements): every
  rank reads the same file, so places the same replicas. With --eplb-interval-steps N the placement follows the load
  while serving (ep/rebalance.py: every N steps, from the last N steps' counts, weights moved between ranks), starting
  from the file's placement or, without one, an even one (eplb_placement of a uniform load).

Where they come from:
- a checkpoint folder (ranks.py, with `rank_expert_ids`): load_model(experts=...) reads only those experts' tensors, so
  a rank never holds another rank's expert weights, not even while loading;
- a model already built in full (a preset's seeded random weights, or a caller's module): `attach_rank_experts` cuts the
  banks to the rank's experts and, with drop_full_banks=True, replaces the full banks so they can be freed.
Either way the backend's shards share storage with the model's (cut) banks: no second copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import cast

import torch

from openk3.model.model import K3ForCausalLM
from openk3.model.moe import DenseExperts, PackedExperts
from openk3.ops.moe.bank import DenseExpertBank
from openk3.parallel.config import EPMethod
from openk3.parallel.ep.backend import EPBackend, TokenSplit
from openk3.parallel.ep.load_stats import eplb_engine_placements
from openk3.parallel.ep.moonep_backend import MoonEPBackend
from openk3.parallel.ep.placement import Placement, contiguous_placement, eplb_placement, redundant_for
from openk3.parallel.ep.rebalance import LiveRebalance, RebalanceConfig
from openk3.parallel.ep.shard import ExpertShard
from openk3.parallel.ep.static_backend import ExpertParallelBackend
from openk3.parallel.group import ParallelContext

EPLB_REDUNDANT_FRACTION = 0.1


def engine_placements(
    model_layers: list[int], num_experts: int, world_size: int, method: EPMethod | str, eplb_stats: str | Path | None, live: bool = False
) -> dict[int, Placement]:
    """The placement of every MoE layer an engine starts with: contiguous homes (ep, moonep), or for eplb the replicas of
    each layer's measured heaviest experts (`eplb_stats`, a load file: without one a ValueError, load_stats.STATS_NEEDED,
    unless `live`: re-placed while serving, it starts even; a file that does not fit the model a LoadStatsError naming
    it). A file with another method is refused, not ignored."""
    chosen = EPMethod(method)
    if chosen is EPMethod.EPLB and eplb_stats is None and live:
        even = eplb_placement(torch.ones(num_experts), world_size, redundant_for(num_experts, world_size, EPLB_REDUNDANT_FRACTION))
        return dict.fromkeys(model_layers, even)
    if chosen is EPMethod.EPLB:
        return eplb_engine_placements(model_layers, num_experts, world_size, eplb_stats, EPLB_REDUNDANT_FRACTION)
    if eplb_stats is not None:
        raise ValueError(f"expert parallel: eplb_stats={str(eplb_stats)!r} with method={chosen.value!r}: a load file places eplb's replicas only")
    if num_experts % world_size:
        raise ValueError(f"expert parallel: method={chosen.value!r} needs the {num_experts} experts to split evenly over ep={world_size} ranks")
    return dict.fromkeys(model_layers, contiguous_placement(num_experts, world_size))


def rank_expert_ids(placements: Mapping[int, Placement], rank: int) -> dict[int, list[int]]:
    return {layer: p.phys_to_log[rank].tolist() for layer, p in placements.items()}


def _cut(experts: DenseExperts | PackedExperts, ids: torch.Tensor) -> DenseExperts | PackedExperts:
    """A module holding only experts `ids` (copied rows, so the full bank can be freed)."""
    e, rows, cols = experts.w1.shape if isinstance(experts, DenseExperts) else cast(torch.Tensor, experts.w1_weight_packed).shape
    cut = DenseExperts(ids.numel(), cols, rows) if isinstance(experts, DenseExperts) else PackedExperts(ids.numel(), 2 * cols, rows)
    with torch.no_grad():
        for name, t in list(experts.named_parameters()) + list(experts.named_buffers()):
            getattr(cut, name).data = t.detach().index_select(0, ids.to(t.device))
    return cut


def attach_rank_experts(
    model: K3ForCausalLM,
    ctx: ParallelContext,
    method: EPMethod | str,
    placements: Mapping[int, Placement],
    loaded_per_rank: bool,
    drop_full_banks: bool = True,
    collect_stats: bool = True,
    replicated_tokens: bool = True,
    split_ctx: ParallelContext | None = None,
    rebalance: RebalanceConfig | None = None,
) -> TokenSplit | EPBackend:
    """Attach the expert-parallel backend (experts sharded; tokens replicated, so wrapped in TokenSplit, or each rank's own
    with data-parallel attention) and return it.

    loaded_per_rank: the model's banks already hold exactly this rank's experts in placement order (loaded with rank_expert_ids);
    otherwise they are full banks, cut here (and replaced when drop_full_banks, else copied so the caller's module keeps
    its own experts). rebalance: eplb re-placed every N steps while serving (ep/rebalance.py)."""
    chosen = EPMethod(method)
    if rebalance is not None and chosen is not EPMethod.EPLB:
        raise ValueError(f"expert parallel: re-placing experts while serving needs method 'eplb', got {chosen.value!r}")
    shards = {}
    for moe in model.moe_layers():
        ids = placements[moe.layer_index].phys_to_log[ctx.rank]
        if not loaded_per_rank and drop_full_banks:
            moe.experts = _cut(moe.experts, ids)
        if loaded_per_rank or drop_full_banks:
            bank = moe.experts.bank()
            if isinstance(bank, DenseExpertBank):
                bank = DenseExpertBank(bank.w1_EID.detach(), bank.w3_EID.detach(), bank.w2_EDI.detach())
            shards[moe.layer_index] = ExpertShard(bank, ids)  # type: ignore[arg-type]  # dense or packed, what shards keep
        else:
            shards[moe.layer_index] = ExpertShard.from_bank(moe.experts.bank(), ids)
    if chosen is EPMethod.MOONEP:
        inner: ExpertParallelBackend | MoonEPBackend = MoonEPBackend(ctx, shards, collect_stats=collect_stats)
    else:
        live = LiveRebalance(rebalance, model.config.moe.num_experts) if rebalance is not None else None
        inner = ExpertParallelBackend(ctx, shards, placements, collect_stats, rebalance=live)
    # the ranks that hold the same tokens split them (split_ctx: the TP group, default every rank), the experts span ctx
    backend: TokenSplit | EPBackend = TokenSplit(split_ctx or ctx, inner) if replicated_tokens else inner
    model.set_expert_backend(backend)
    return backend


def resident_expert_bytes(model: K3ForCausalLM, backend: TokenSplit | EPBackend | None = None) -> int:
    """Bytes of routed-expert weights this process holds: the model's banks and the backend's shards, each storage once."""
    tensors = [t for moe in model.moe_layers() for t in list(moe.experts.parameters()) + list(moe.experts.buffers())]
    if backend is not None:
        inner = backend.inner if isinstance(backend, TokenSplit) else backend
        for shard in getattr(inner, "shards", {}).values():
            bank = shard.bank
            if isinstance(bank, DenseExpertBank):
                tensors += [bank.w1_EID, bank.w3_EID, bank.w2_EDI]
            else:
                tensors += [x for t in (bank.w1, bank.w3, bank.w2) for x in (t.packed, t.scales)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}
    return sum(storages.values())
