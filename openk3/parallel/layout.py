"""apply_serving_layout: the one ordered place where a model is laid out for serving, on one rank or on many (as
torchtitan's parallelize_* and gpt-fast's _load_model do): cut the trunk tensor-parallel, attach the expert-parallel
backend, then prepare the result (serve/prepare.py: the named ops, fused projections, packed CPU weights).

The order is the point: the cut changes the projections' shapes, and preparing ties the projections it finds, so it must
see the cut ones; the experts attached must be the (cut) banks the model keeps; and the ops are resolved last, for the
shapes and the backends the model ends with. A checkpoint folder is cut while it loads (a rank never holds another
rank's weights, parallel/serving/rank_model.py), so its plan says so (`ServingPlan.loaded`) and the rest runs here alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

import torch

from openk3.model.model import K3ForCausalLM
from openk3.parallel.config import EPMethod
from openk3.parallel.ep.backend import EPBackend, TokenSplit
from openk3.parallel.ep.placement import Placement
from openk3.parallel.ep.rebalance import RebalanceConfig
from openk3.parallel.group import ParallelContext
from openk3.parallel.serving.rank_model import attach_rank_experts
from openk3.parallel.tp.shard import TensorSplits, parallelize_tensor
from openk3.serve.prepare import prepare_for_serving


@dataclass(frozen=True)
class TensorParallelCut:
    """Cut the trunk to this rank's blocks over `group` (its tensor-parallel ranks); `split_experts`: also split every
    routed expert by width (tensor parallelism without expert parallelism)."""

    group: ParallelContext
    split_experts: bool

    def apply(self, model: K3ForCausalLM) -> TensorSplits:
        return parallelize_tensor(model, self.group, split_experts=self.split_experts)


@dataclass(frozen=True)
class ExpertLayout:
    """Which experts this rank holds and how tokens reach them (rank_model.attach_rank_experts has the details)."""

    ctx: ParallelContext  # every rank the experts are spread over
    method: EPMethod | str
    placements: Mapping[int, Placement]  # per MoE layer
    split_ctx: ParallelContext  # the ranks that hold the same tokens and split them before dispatch
    replicated_tokens: bool  # False with data-parallel attention alone: each rank dispatches its own tokens
    collect_stats: bool
    drop_full_banks: bool = True  # False: the full banks stay (a caller's module keeps its experts; the shards are copies)
    loaded_per_rank: bool = False  # the banks already hold exactly this rank's experts (loaded so)
    rebalance: RebalanceConfig | None = None  # eplb: re-place the experts every N steps while serving (ep/rebalance.py)


@dataclass(frozen=True)
class ServingPlan:
    """How one model is served: where, cut how, with which experts, with which named ops, packed or not."""

    device: torch.device
    tensor_parallel: TensorParallelCut | None = None
    experts: ExpertLayout | None = None
    ops: Mapping[str, str | int] | None = None  # EngineConfig.op_names
    pack_cpu_weights: bool = False

    def loaded(self) -> ServingPlan:
        """This plan for a model loaded with its cut and its own experts already (a checkpoint folder read per rank)."""
        experts = dataclasses.replace(self.experts, loaded_per_rank=True) if self.experts is not None else None
        return dataclasses.replace(self, tensor_parallel=None, experts=experts)


def apply_serving_layout(model: torch.nn.Module, plan: ServingPlan) -> TokenSplit | EPBackend | None:
    """Lay `model` out for serving in place, in the order the module docstring gives; returns the expert-parallel backend
    attached (None without expert parallelism). A cut or experts need a K3ForCausalLM; preparing takes any module."""
    if plan.tensor_parallel is not None:
        plan.tensor_parallel.apply(cast(K3ForCausalLM, model))
    backend = None
    if plan.experts is not None:
        e = plan.experts
        backend = attach_rank_experts(
            cast(K3ForCausalLM, model),
            e.ctx,
            e.method,
            e.placements,
            e.loaded_per_rank,
            drop_full_banks=e.drop_full_banks,
            collect_stats=e.collect_stats,
            replicated_tokens=e.replicated_tokens,
            split_ctx=e.split_ctx,
            rebalance=e.rebalance,
        )
    prepare_for_serving(model, plan.device, plan.pack_cpu_weights, plan.ops)
    return backend
