"""Kimi Delta Attention layer (both the Kimi-Linear and the K3 parameterisation).

Legend: T packed tokens of the step, N sequences, D hidden, H heads, K = V = head_dim, P = H * K, W conv kernel,
S state slots. Parameter names are the checkpoint's (`q_proj`, `q_conv1d`, `f_a_proj`, `A_log`, `dt_bias`, `b_proj`,
`g_proj` or `g_a_proj`/`g_b_proj`, `o_norm`, `o_proj`).

Cache contract (see model/batch.py): the layer reads the conv windows and the recurrent state of each sequence from its
slot (zeros when the sequence has no context yet) and writes the state after the step back into the same slot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from openk3.config import KDAGate, ModelConfig
from openk3.model.batch import ForwardBatch
from openk3.model.kda_cuts import KDAPrefill, check_cuts, conv_windows_at_cuts, prefill_with_cuts
from openk3.model.layers import Linear, ProjectionGroup, RMSNorm, StackedWeights
from openk3.ops.kda.decode_step import KDADecodeStep, KDALayerWeights, KDASlots, delta_rule_inputs, gated_output, gather_slots
from openk3.ops.registry import CPU_INFERENCE, OpTarget, OpUse, op, registry


@dataclass(frozen=True)
class KDALayerCache:
    state_SHKV: torch.Tensor  # fp32 recurrent states, one per slot
    conv_SCW: torch.Tensor  # conv windows (last W-1 pre-conv inputs of q | k | v)


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: ModelConfig, kda_impl: str = "auto", conv_impl: str = "auto") -> None:
        super().__init__()
        c = config.kda
        d, p = config.hidden_size, c.proj_dim
        self.num_heads, self.head_dim, self.conv_kernel = c.num_heads, c.head_dim, c.conv_kernel
        self.gate_kind, self.gate_lower_bound = c.gate, c.gate_lower_bound
        self.eps = config.rms_norm_eps
        self.q_proj = Linear(d, p, bias=False)
        self.k_proj = Linear(d, p, bias=False)
        self.v_proj = Linear(d, p, bias=False)
        self.q_conv1d = nn.Conv1d(p, p, c.conv_kernel, groups=p, bias=False)
        self.k_conv1d = nn.Conv1d(p, p, c.conv_kernel, groups=p, bias=False)
        self.v_conv1d = nn.Conv1d(p, p, c.conv_kernel, groups=p, bias=False)
        self.f_a_proj = Linear(d, c.head_dim, bias=False)
        self.f_b_proj = Linear(c.head_dim, p, bias=False)
        self.A_log = nn.Parameter(torch.zeros(c.num_heads))
        self.dt_bias = nn.Parameter(torch.zeros(p))
        self.b_proj = Linear(d, c.num_heads, bias=False)
        self.full_rank_output_gate = c.full_rank_output_gate
        if c.full_rank_output_gate:
            self.g_proj = Linear(d, p, bias=False)
        else:
            self.g_a_proj = Linear(d, c.head_dim, bias=False)
            self.g_b_proj = Linear(c.head_dim, p, bias=False)
        self.o_norm = RMSNorm(c.head_dim, config.rms_norm_eps)
        self.o_proj = Linear(p, d, bias=False)
        self.select(kda_impl, conv_impl, CPU_INFERENCE)
        # the projections of the input: [q | k | v] (pre-conv, side by side), f_a, g (or g_a), b
        self.in_proj = ProjectionGroup(self._in_linears(), pieces=(3, 1, 1, 1))
        self.conv_weights = StackedWeights([self.q_conv1d, self.k_conv1d, self.v_conv1d])  # q | k | v, as the conv windows are

    @torch.no_grad()
    def reset_gate_parameters(self, generator: torch.Generator | None = None) -> None:
        """Spec init: A_log = log U(1, 16) for the softplus gate (0 for the lower-bound gate); dt = exp(U(log 1e-3, log 1e-1))."""
        if self.gate_kind == KDAGate.SOFTPLUS:
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0, generator=generator).log())
        else:
            self.A_log.zero_()
        dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1), generator=generator).exp().clamp_min(1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def _in_linears(self) -> tuple[Linear, ...]:
        gate = self.g_proj if self.full_rank_output_gate else self.g_a_proj
        return (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, gate, self.b_proj)

    def select(self, kda_impl: str, conv_impl: str, target: OpTarget, chunk_size: int | None = None) -> None:
        """The prefill form by name (ops/registry.py "kda_prefill", "short_conv"), "auto" resolved for `target`, and the
        decode form ("kda_decode") by its "auto" rule, which pairs it with the prefill and this layer's head size;
        `chunk_size` for the chunkwise forms (their own default when None)."""
        use = OpUse(head_dim=self.head_dim, chunk_size=chunk_size)
        prefill_name = registry().entry("kda_prefill", kda_impl, target)[0]
        self.kda_prefill: KDAPrefill = registry().get("kda_prefill", prefill_name, target, use)
        self.kda_decode: KDADecodeStep = registry().get("kda_decode", "auto", target, replace(use, paired_with=prefill_name))
        self.conv_prefill = op("short_conv", conv_impl, target)

    def conv_weight(self) -> torch.Tensor:
        """[3P, W]: the three depthwise kernels stacked in q | k | v order, as the conv windows are."""
        return self.conv_weights().squeeze(1)

    def input_projections(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """([q | k | v] before the conv [T, 3P], f_a [T, K], g or g_a [T, P or K], b [T, H])."""
        qkv, f_a, g, b = self.in_proj(x_TD)
        return qkv, f_a, g, b

    def layer_weights(self) -> KDALayerWeights:
        return KDALayerWeights(self.conv_weight(), self.A_log, self.dt_bias, self.gate_kind, self.gate_lower_bound, self.o_norm, self.o_norm.weight, self.eps)

    def forward(self, x_TD: torch.Tensor, batch: ForwardBatch, cache: KDALayerCache | None) -> torch.Tensor:
        qkv_TC, f_a, gate_in, b_logit = self.input_projections(x_TD)
        f_TP = self.f_b_proj(f_a)
        gate_TP = gate_in if self.full_rank_output_gate else self.g_b_proj(gate_in)
        if batch.is_decode and cache is not None:
            assert batch.state_slots is not None
            slots = KDASlots(cache.state_SHKV, cache.conv_SCW, batch.state_slots, batch.fresh_seqs, batch.slot_range)
            o_TP = self.kda_decode(qkv_TC, f_TP, b_logit, gate_TP, self.layer_weights(), slots)
        else:
            o_TP = self._prefill(qkv_TC, f_TP, b_logit, gate_TP, batch, cache)
        return self.o_proj(o_TP.to(x_TD.dtype))

    def _prefill(
        self, qkv_TC: torch.Tensor, f_TP: torch.Tensor, b_TH: torch.Tensor, gate_TP: torch.Tensor, batch: ForwardBatch, cache: KDALayerCache | None
    ) -> torch.Tensor:
        """Conv and delta rule over the step's sequences (cu_seqlens), from their slots' states when there is a cache."""
        weights = self.layer_weights()
        init_conv = init_state = None
        if cache is not None:
            assert batch.state_slots is not None
            init_conv = gather_slots(cache.conv_SCW, batch.state_slots, batch.fresh_seqs)
            init_state = gather_slots(cache.state_SHKV, batch.state_slots, batch.fresh_seqs)
        y, conv_state = self.conv_prefill(qkv_TC[None], weights.conv_weight_CW, init_conv, batch.cu_seqlens, activation="silu")
        q, k, v, g, beta = delta_rule_inputs(y[0], f_TP, b_TH, weights, self.num_heads)
        if cache is not None and batch.state_cuts:
            o, new_state = self._prefill_with_cuts((q[None], k[None], v[None], g[None], beta[None]), qkv_TC, init_state, init_conv, batch, cache)
        else:
            o, new_state = self.kda_prefill(q[None], k[None], v[None], g[None], beta[None], None, init_state, batch.cu_seqlens)
        if cache is not None:
            assert batch.state_slots is not None
            cache.conv_SCW.index_copy_(0, batch.state_slots, conv_state.to(cache.conv_SCW.dtype))
            cache.state_SHKV.index_copy_(0, batch.state_slots, new_state)
        return gated_output(o[0], gate_TP, self.o_norm)

    def _prefill_with_cuts(
        self,
        inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        qkv_TC: torch.Tensor,
        init_state: torch.Tensor | None,
        init_conv: torch.Tensor | None,
        batch: ForwardBatch,
        cache: KDALayerCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The delta rule piece by piece (model/kda_cuts.py), writing the state and conv window at each of the batch's
        state_cuts into the cut's slot; (o, final states) as the op returns them."""
        cu = batch.host_cu_seqlens
        per_seq = check_cuts(batch.state_cuts, cu)
        o, new_state, taken = prefill_with_cuts(self.kda_prefill, inputs, init_state, cu, per_seq)
        windows = dict(zip(batch.state_cuts, conv_windows_at_cuts(qkv_TC, init_conv, cu, batch.state_cuts, self.conv_kernel - 1), strict=True))
        for cut, state in taken:
            cache.state_SHKV[cut.slot].copy_(state)
            cache.conv_SCW[cut.slot].copy_(windows[cut])
        return o, new_state
