"""The serving layout of a latent MoE layer on CPU (prepare_for_serving with pack_cpu_weights): at decode sizes, the layer
after its router as one call of the registry's "moe_latent_block" (ops/moe/block_c.py) instead of ~10 module and kernel
calls; the same kernels' code in the same order, so the same bits (tests/serve/test_fused_moe.py).

Why: on the demo model at 16 rows a MoE layer's Python and torch dispatch (~390 us) outweighed its kernels (~240 us); the
block in one call takes the dispatch away (issue 42, benchmarks/results/roofline.md).

ServedLatentMoE is the same module with a forward that takes the one call only where the separate calls would have run
exactly those kernels: the local expert backend with the C packed-expert loop, the C forms of every projection (from
their panel copies, which ops/linear.py PackedWeight checks against the weights on every use), of the latent norm and of
the shared experts' activation, and a step of at most PANEL_ROWS rows. Anything else -- an expert-parallel backend, ops
named otherwise, more rows, autograd on -- runs the layer's own forward. Where the gate routes with the C router and
nothing wraps it (no `route` set on the layer, as a recorder would; the gate's function the registry's, which routing
replay replaces), the router's top-k runs inside the same call ("moe_routed_latent_block": ~2-3% of a demo decode step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from openk3.model.layers import GatedMLP, ProjectionGroup
from openk3.model.moe import LatentMoE, LocalExperts, PackedExperts
from openk3.ops.glu_c import glu_c
from openk3.ops.moe.block_c import LatentBlockWeights
from openk3.ops.moe.cpu_pairs import MAX_K
from openk3.ops.moe.packed_bank import PackedMXFP4ExpertBank
from openk3.ops.moe.packed_c import packed_c_fits
from openk3.ops.norm import rms_norm_c
from openk3.ops.registry import OpTarget, registry
from openk3.ops.thresholds import C_LOOP_MAX_PAIRS_PER_EXPERT, PANEL_ROWS
from openk3.serve.panel_copies import group_panels, hooked, kept, linear_panels, tensor_stamp


class ServedLatentMoE(LatentMoE):
    block: Callable[..., torch.Tensor]  # the "moe_latent_block" C form
    routed_block: Callable[..., torch.Tensor]  # the "moe_routed_latent_block" C form
    route_c: object  # the "moe_route" C form, whose top-k the routed block runs
    sized_c: object  # the "moe_experts" entry whose choice the block reproduces (the "c" backend's "sized")

    @classmethod
    def from_moe(cls, source: LatentMoE, target: OpTarget) -> ServedLatentMoE:
        """The same module (parameters, buffers, hooks and outside references stay), turned into a ServedLatentMoE."""
        source.__class__ = cls
        served = cast(ServedLatentMoE, source)
        served.block = registry().get("moe_latent_block", "fast", target)
        served.routed_block = registry().get("moe_routed_latent_block", "fast", target)
        served.route_c = registry().get("moe_route", "fast", target)
        served.sized_c = registry().get("moe_experts", "sized", target)
        return served

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        weights = self.block_weights(x_TD)
        if weights is None:
            return super().forward(x_TD)
        gate = self.gate
        if "route" not in self.__dict__ and gate.route is self.route_c and self.top_k <= MAX_K:  # nothing wraps the router
            return self.routed_block(x_TD, gate.weight, gate.e_score_correction_bias, self.top_k, self.renormalize, self.scaling, weights)
        routing = self.route(x_TD)
        return self.block(x_TD, routing.topk_idx, routing.topk_weight, weights)

    def block_weights(self, x_TD: torch.Tensor) -> LatentBlockWeights | None:
        """The block's weights with their panel copies when the one call gives what the separate calls would, else None.
        Found once and kept while `_stamp` -- the backend and the ops chosen, the submodules, every weight's and expert
        buffer's identity, address and version -- stays the same (finding them costs ~45 us per layer and step)."""
        rows = x_TD.shape[0] if x_TD.dim() == 2 else 0
        if not 1 <= rows <= PANEL_ROWS or torch.is_grad_enabled() or x_TD.dtype != torch.float32 or not self.latent or self.shared_experts is None:
            return None
        if rows * self.top_k > C_LOOP_MAX_PAIRS_PER_EXPERT * self.gate.weight.shape[0]:
            return None
        mods = self._modules
        shared = cast(GatedMLP, mods["shared_experts"])
        norm = mods["routed_expert_norm"]
        if hooked(cast(nn.Module, mods["routed_expert_down_proj"]), cast(nn.Module, mods["routed_expert_up_proj"]), shared, *(() if norm is None else (norm,))):
            return None
        if hooked(cast(nn.Module, shared._modules["gate_up"]), cast(nn.Module, shared._modules["down_proj"])):
            return None
        return kept(self, *self._stamp(), lambda: self._find_weights(x_TD))

    def _stamp(self) -> tuple[tuple | None, list[torch.Tensor]]:
        """(what the found weights depend on; None for inference tensors), the tensors it stamps."""
        mods = self._modules
        down, up, norm, experts = (mods[n] for n in ("routed_expert_down_proj", "routed_expert_up_proj", "routed_expert_norm", "experts"))
        shared = cast(GatedMLP, mods["shared_experts"])
        gate_up, shared_down = cast(ProjectionGroup, shared._modules["gate_up"]), cast(nn.Module, shared._modules["down_proj"])
        linears: list[nn.Module] = [cast(nn.Module, down), cast(nn.Module, up), *gate_up.members, shared_down]
        tensors = [cast(torch.Tensor, m._parameters["weight"]) for m in linears]
        if norm is not None:
            tensors.append(cast(torch.Tensor, norm._parameters["weight"]))
        if experts is not None:
            tensors.extend(cast(torch.Tensor, t) for t in experts._buffers.values())
        stamp_of = tensor_stamp(tensors)
        if stamp_of is None:
            return None, tensors
        backend = self.backend
        ops: tuple = (backend, getattr(backend, "op", None), getattr(backend, "decode", None), shared.__dict__.get("glu"), self.expert_act)
        ops += tuple(m.__dict__.get("linear") for m in linears) + (None if norm is None else norm.__dict__.get("norm"),)
        return (down, up, norm, experts, shared, gate_up, shared_down, ops, stamp_of), tensors

    def _find_weights(self, x_TD: torch.Tensor) -> LatentBlockWeights | None:
        backend, shared, experts = self.backend, self.shared_experts, self.experts
        if shared is None or type(backend) is not LocalExperts or backend.op is not self.sized_c or not isinstance(experts, PackedExperts):
            return None
        bank = experts.bank(backend.decode)
        norm = self.routed_expert_norm
        if not isinstance(bank, PackedMXFP4ExpertBank) or not packed_c_fits(x_TD, bank, self.expert_act) or (norm is not None and norm.norm is not rms_norm_c):
            return None
        down, up = self.routed_expert_down_proj, self.routed_expert_up_proj
        gate_up = group_panels(shared.gate_up) if shared.glu is glu_c and shared.gate_up.widths == [shared.intermediate] * 2 else None
        panels = (linear_panels(down), linear_panels(up), gate_up[1] if gate_up is not None else None, linear_panels(shared.down_proj))
        if gate_up is None or any(p is None for p in panels):
            return None
        return LatentBlockWeights(
            down.weight, bank, self.expert_act, norm.weight if norm is not None else None, norm.eps if norm is not None else 0.0,
            up.weight, gate_up[0], shared.act, shared.situ_beta, shared.situ_linear_beta, shared.down_proj.weight,
            cast(tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], panels),
        )  # fmt: skip
