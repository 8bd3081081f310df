"""Stable LatentMoE: sigmoid router with a selection-only bias, latent down/up projections around the routed experts,
a latent RMSNorm after the weighted sum, and full-width shared experts. With `latent_size=None` it is Kimi-Linear's MoE.

Legend: T tokens, D hidden, Dl expert width (latent width, or D without latent), E experts, k experts per token,
I expert intermediate width.

The routed-expert computation goes through an `ExpertBackend`: the single seam where expert parallelism (openk3.parallel)
attaches. The default backend runs every expert locally from the layer's expert bank.
"""

from __future__ import annotations

import functools
from typing import Protocol, cast, runtime_checkable

import torch
from torch import nn

from openk3.config import ModelConfig
from openk3.model.layers import GatedMLP, Linear, RMSNorm
from openk3.ops.activation import glu
from openk3.ops.moe.bank import DenseExpertBank, ExpertBank
from openk3.ops.moe.packed_bank import PROJECTIONS, DecodeFn, PackedMXFP4ExpertBank
from openk3.ops.moe.router import RouterOutput
from openk3.ops.mxfp4 import MX_BLOCK, MXFP4Tensor, dequantize
from openk3.ops.registry import CPU_INFERENCE, OpTarget, op


class ExpertBackend(Protocol):
    def __call__(self, layer: LatentMoE, z_TD: torch.Tensor, routing: RouterOutput) -> torch.Tensor:
        """Return sum_j w[t, j] * expert_{idx[t, j]}(z[t]) for every token, [T, Dl]."""
        ...


@runtime_checkable
class SelectsExpertOps(Protocol):
    """A backend that runs routed experts locally through a registry op (a tensor-parallel slice of every expert, say):
    K3ForCausalLM.select_ops hands it the model's choice and target, as it rebuilds LocalExperts."""

    def select(self, impl: str, target: OpTarget) -> None: ...


class LocalExperts:
    """All experts on this device; `impl` names the routed-expert implementation (ops/registry.py "moe_experts")."""

    def __init__(self, impl: str = "auto", target: OpTarget = CPU_INFERENCE) -> None:
        self.impl = impl
        self.op = op("moe_experts", impl, target)
        self.decode = op("mxfp4_decode", "auto", target)  # how a packed bank decodes the experts it is asked for

    def __call__(self, layer: LatentMoE, z_TD: torch.Tensor, routing: RouterOutput) -> torch.Tensor:
        experts = layer.experts
        bank = experts.bank(self.decode) if isinstance(experts, PackedExperts) else experts.bank()
        return self.op(z_TD, routing.topk_idx, routing.topk_weight, bank, layer.expert_act)


class Router(nn.Module):
    """`weight` [E, D] and `e_score_correction_bias` [E], both fp32 (the checkpoint keeps them in fp32); the top-k by the
    registry's "moe_route"."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden, dtype=torch.float32))
        self.e_score_correction_bias: torch.Tensor
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.select(CPU_INFERENCE)

    def select(self, target: OpTarget, impl: str = "auto") -> None:
        self.route = op("moe_route", impl, target)


class DenseExperts(nn.Module):
    """Routed experts in full precision, stacked: w1, w3 [E, I, Dl], w2 [E, Dl, I]."""

    def __init__(self, num_experts: int, width: int, intermediate: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, intermediate, width))
        self.w3 = nn.Parameter(torch.empty(num_experts, intermediate, width))
        self.w2 = nn.Parameter(torch.empty(num_experts, width, intermediate))

    def bank(self) -> ExpertBank:
        return DenseExpertBank(self.w1, self.w3, self.w2)


class PackedExperts(nn.Module):
    """Routed experts as packed MXFP4 buffers (the K3 checkpoint layout stacked over experts): `{w}_weight_packed` uint8
    [E, rows, cols/2] and `{w}_weight_scale` uint8 E8M0 [E, rows, cols/32] for w in w1, w3, w2. The bank decodes one
    expert at a time, so the layer's full-precision weights never exist at once."""

    _BUFFERS = tuple(f"{w}_weight_{kind}" for w in PROJECTIONS for kind in ("packed", "scale"))

    def __init__(self, num_experts: int, width: int, intermediate: int) -> None:
        super().__init__()
        self._bank: tuple[DecodeFn, tuple[torch.Tensor, ...], ExpertBank] | None = None
        shapes = {"w1": (intermediate, width), "w3": (intermediate, width), "w2": (width, intermediate)}
        for name, (rows, cols) in shapes.items():
            self.register_buffer(f"{name}_weight_packed", torch.zeros(num_experts, rows, cols // 2, dtype=torch.uint8))
            self.register_buffer(f"{name}_weight_scale", torch.zeros(num_experts, rows, cols // MX_BLOCK, dtype=torch.uint8))

    def bank(self, decode: DecodeFn = dequantize) -> ExpertBank:
        """The bank over these buffers; `decode`: the "mxfp4_decode" form its experts are decoded with. Kept while the
        buffers are the same tensors (it holds them, so in-place writes show; `.to()` or a new buffer makes a new bank):
        building it checks six shapes, ~45 us per MoE layer per step (issue 42)."""
        buffers = tuple(cast(torch.Tensor, self._buffers[name]) for name in self._BUFFERS)
        held = self._bank
        if held is not None and held[0] is decode and all(a is b for a, b in zip(held[1], buffers, strict=True)):
            return held[2]
        pairs = (MXFP4Tensor(buffers[2 * i], buffers[2 * i + 1]) for i in range(len(PROJECTIONS)))
        bank = PackedMXFP4ExpertBank(*pairs, decode=decode)
        self._bank = (decode, buffers, bank)
        return bank

    @staticmethod
    def from_dense(experts: DenseExperts) -> PackedExperts:
        e, i, d = experts.w1.shape
        packed = PackedExperts(e, d, i).to(experts.w1.device)
        bank = PackedMXFP4ExpertBank.from_dense(experts.w1.detach().float(), experts.w3.detach().float(), experts.w2.detach().float())
        for name, t in zip(PROJECTIONS, (bank.w1, bank.w3, bank.w2), strict=True):
            getattr(packed, f"{name}_weight_packed").copy_(t.packed)
            getattr(packed, f"{name}_weight_scale").copy_(t.scales)
        return packed


class LatentMoE(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, backend: ExpertBackend | None = None, packed_experts: bool = False) -> None:
        super().__init__()
        self.layer_index = layer_index  # lets an expert-parallel backend find this layer's expert shard
        e, d = config.moe, config.hidden_size
        width = e.latent_size or d
        self.top_k, self.renormalize, self.scaling = e.num_experts_per_token, e.renormalize, e.routed_scaling_factor
        self.gate = Router(d, e.num_experts)
        experts_cls = PackedExperts if packed_experts else DenseExperts
        self.experts: DenseExperts | PackedExperts = experts_cls(e.num_experts, width, e.moe_intermediate_size)
        self.expert_act = functools.partial(glu, kind=config.hidden_act, beta=config.situ_beta, linear_beta=config.situ_linear_beta)
        self.latent = e.latent_size is not None
        if self.latent:
            assert e.latent_size is not None
            self.routed_expert_down_proj = Linear(d, e.latent_size, bias=False)
            self.routed_expert_up_proj = Linear(e.latent_size, d, bias=False)
            self.routed_expert_norm = RMSNorm(e.latent_size, config.rms_norm_eps) if e.latent_norm else None
        self.shared_experts = (
            GatedMLP(d, e.moe_intermediate_size * e.num_shared_experts, config.hidden_act, config.situ_beta, config.situ_linear_beta)
            if e.num_shared_experts
            else None
        )
        self.backend: ExpertBackend = backend or LocalExperts()

    def route(self, x_TD: torch.Tensor) -> RouterOutput:
        return self.gate.route(x_TD, self.gate.weight, self.gate.e_score_correction_bias, self.top_k, self.renormalize, self.scaling)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        routing = self.route(x_TD)
        z = self.routed_expert_down_proj(x_TD) if self.latent else x_TD
        y = self.backend(self, z, routing)
        if self.latent:
            if self.routed_expert_norm is not None:
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x_TD)
        return y
