"""Kimi Delta Attention layer (both the Kimi-Linear and the K3 parameterisation).

Legend: T packed tokens of the step, N sequences, D hidden, H heads, K = V = head_dim, P = H * K, W conv kernel,
S state slots. Parameter names are the checkpoint's (`q_proj`, `q_conv1d`, `f_a_proj`, `A_log`, `dt_bias`, `b_proj`,
`g_proj` or `g_a_proj`/`g_b_proj`, `o_norm`, `o_proj`).

Cache contract (see model/batch.py): the layer reads the conv windows and the recurrent state of each sequence from its
slot (zeros when the sequence has no context yet) and writes the state after the step back into the same slot.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from openk3.config import KDAGate, ModelConfig
from openk3.model.batch import ForwardBatch
from openk3.model.layers import Linear, ProjectionGroup, RMSNorm, StackedWeights
from openk3.ops.kda.decode import kda_decode
from openk3.ops.kda.decode_fused import MAX_HEAD_DIM, kda_decode_fused
from openk3.ops.kda.decode_inplace import kda_decode_
from openk3.ops.kda.gate import kda_gate
from openk3.ops.kda.mixed import kda_mixed
from openk3.ops.norm import l2_norm
from openk3.ops.registry import CPU_INFERENCE, OpTarget, op, registry
from openk3.ops.short_conv import causal_conv1d_update, causal_conv1d_update_

FLA_PREFILLS = ("fla", "fla_recurrent")  # the "kda_prefill" entries that run fla's kernels (ops/kda/fla_kernels.py)


@dataclass(frozen=True)
class KDALayerCache:
    state_SHKV: torch.Tensor  # fp32 recurrent states, one per slot
    conv_SCW: torch.Tensor  # conv windows (last W-1 pre-conv inputs of q | k | v)


def _slot_states(pool: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """The slots' contents, with sequences that start fresh (no context) reading zeros whatever the slot holds."""
    assert batch.state_slots is not None
    states = pool.index_select(0, batch.state_slots)
    fresh = batch.fresh_seqs
    if fresh is None:
        return states
    return states.masked_fill(fresh.view(-1, *([1] * (states.dim() - 1))), 0.0)


def _advance_in_pool(pool: torch.Tensor, batch: ForwardBatch, step: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Run `step` (an op that advances the states it is given in place) on the batch's slots where they live: through a slice
    of the pool when the step's slots are consecutive, else on a gathered copy that is written back. The decode step's
    KDA state and conv windows both go this way (ops/kda/decode_inplace.py says why it is the fast path)."""
    assert batch.state_slots is not None
    span = batch.slot_range
    if span is None:
        states = _slot_states(pool, batch)
        out = step(states)
        pool.index_copy_(0, batch.state_slots, states)
        return out
    states = pool[span[0] : span[1]]
    if batch.fresh_seqs is not None:  # no context yet: start from zero whatever the slot holds
        states.masked_fill_(batch.fresh_seqs.view(-1, *([1] * (states.dim() - 1))), 0.0)
    return step(states)


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
        """The prefill implementations by name (ops/registry.py "kda_prefill", "short_conv"), "auto" resolved for `target`;
        `chunk_size` for the chunkwise forms (their own default when None)."""
        name, entry = registry().entry("kda_prefill", kda_impl, target)
        prefill: Callable[..., tuple[torch.Tensor, torch.Tensor]] = registry().get("kda_prefill", name, target)
        if chunk_size is not None and name in ("fast", "autograd"):
            prefill = functools.partial(prefill, chunk_size=chunk_size)
        self.kda_prefill, self.kda_prefill_name = prefill, name
        self.kda_prefill_differentiable = entry.differentiable
        self.conv_prefill = op("short_conv", conv_impl, target)
        # the decode token ("kda_decode"): the definitions when the prefill runs them too (naive), fla's recurrent kernel
        # when the prefill runs fla's (CUDA: decode tokens as one-token sequences of one varlen call), else "auto"
        decode, decode_entry = registry().entry("kda_decode", "naive" if name == "naive" else "auto", target)
        self.fla_decode: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        if name in FLA_PREFILLS:
            self.decode_form = "fla"
            self.fla_decode = registry().get("kda_prefill", "fla_recurrent", target)
        elif decode == "naive":
            self.decode_form = "reference"  # old state in, new state out: differentiable, and the order every form is checked in
        elif decode_entry.backend == "c" and self.head_dim <= MAX_HEAD_DIM:
            self.decode_form = "fused"  # the whole token in one C call (ops/kda/decode_fused.py)
        else:
            self.decode_form = "in_pool"  # conv windows and states advanced where they live, torch ops
        self.reference_ops = name == "naive"  # rule 1: "naive" runs the definitions on every kind of step

    def conv_weight(self) -> torch.Tensor:
        """[3P, W]: the three depthwise kernels stacked in q | k | v order, as the conv windows are."""
        return self.conv_weights().squeeze(1)

    def input_projections(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """([q | k | v] before the conv [T, 3P], f_a [T, K], g or g_a [T, P or K], b [T, H])."""
        qkv, f_a, g, b = self.in_proj(x_TD)
        return qkv, f_a, g, b

    def _decode_fused(
        self, qkv_TC: torch.Tensor, f_TP: torch.Tensor, gate: torch.Tensor, b_logit: torch.Tensor, batch: ForwardBatch, cache: KDALayerCache | None
    ) -> torch.Tensor:
        """The decode token from the projections on through the output gate in one CPU kernel (ops/kda/decode_fused.py)."""
        assert cache is not None and batch.state_slots is not None
        return kda_decode_fused(
            qkv_TC, self.conv_weight(), cache.conv_SCW, batch.state_slots, batch.fresh_seqs, f_TP, self.A_log, self.dt_bias,
            b_logit, cache.state_SHKV, self.gate_kind, self.gate_lower_bound, self.o_norm.weight, self.eps, gate,
        )  # fmt: skip

    @staticmethod
    def _refuse_autograd(x: torch.Tensor, step: str, form: str) -> None:
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError(
                f"the KDA {step} {form!r} is inference-only; for training select the differentiable forms (model.select_ops("
                "target=OpTarget(training=True)), or OpChoice(kda='autograd') / 'naive' by name), or run under torch.no_grad()"
            )

    def forward(self, x_TD: torch.Tensor, batch: ForwardBatch, cache: KDALayerCache | None) -> torch.Tensor:
        t = x_TD.shape[0]
        h, k = self.num_heads, self.head_dim
        qkv_TC, f_a, gate_in, b_logit = self.input_projections(x_TD)
        f_TP = self.f_b_proj(f_a)  # both paths below need the gate pre-activation and the output gate
        gate = gate_in if self.full_rank_output_gate else self.g_b_proj(gate_in)
        decode = batch.is_decode and cache is not None
        if decode and self.decode_form != "reference":
            self._refuse_autograd(qkv_TC, "decode", self.decode_form)
            if self.decode_form == "fused":
                return self.o_proj(self._decode_fused(qkv_TC, f_TP, gate, b_logit, batch, cache).to(x_TD.dtype))
        # the serving path: conv windows and KDA states advanced where they live in the pools, no gather and scatter
        in_pool = decode and self.decode_form == "in_pool"

        conv_state = None
        if in_pool:
            assert cache is not None
            pre_conv, weight = qkv_TC, self.conv_weight()
            qkv_TC = _advance_in_pool(cache.conv_SCW, batch, lambda window: causal_conv1d_update_(pre_conv, weight, window, "silu"))
        elif decode:
            assert cache is not None and batch.state_slots is not None
            qkv_TC, conv_state = causal_conv1d_update(qkv_TC, self.conv_weight(), _slot_states(cache.conv_SCW, batch), activation="silu")
        else:
            init_conv = _slot_states(cache.conv_SCW, batch) if cache is not None else None
            y, conv_state = self.conv_prefill(qkv_TC[None], self.conv_weight(), init_conv, batch.cu_seqlens, activation="silu")
            qkv_TC = y[0]
        qkv = qkv_TC.view(t, 3, h, k)
        q, kk = l2_norm(qkv[:, :2]).unbind(1)  # q and k normalised in one pass
        v = qkv[:, 2]

        g_THK = kda_gate(f_TP.view(t, h, k), self.A_log, self.dt_bias, self.gate_kind, self.gate_lower_bound)
        beta_TH = torch.sigmoid(b_logit.float())

        if in_pool:  # the state read once and advanced in place (ops/kda/decode_inplace.py)
            assert cache is not None
            o_THV = _advance_in_pool(cache.state_SHKV, batch, lambda state: kda_decode_(q, kk, v, g_THK, beta_TH, state))
        elif decode and self.fla_decode is not None:  # fla's fused recurrence over t one-token sequences, states gathered
            assert cache is not None
            one_each = torch.arange(t + 1, dtype=torch.int64, device=q.device)
            o, new_state = self.fla_decode(q[None], kk[None], v[None], g_THK[None], beta_TH[None], None, _slot_states(cache.state_SHKV, batch), one_each)
            o_THV = o[0]
        elif decode:  # the reference order, and the differentiable form: old state in, new state out
            assert cache is not None
            o_THV, new_state = kda_decode(q, kk, v, g_THK, beta_TH, _slot_states(cache.state_SHKV, batch))
        else:
            if not self.kda_prefill_differentiable:
                self._refuse_autograd(q, "prefill", self.kda_prefill_name)
            init = _slot_states(cache.state_SHKV, batch) if cache is not None else None
            if init is not None and not self.reference_ops and self.fla_decode is None:  # single-token sequences take the decode kernel (ops/kda/mixed.py)
                o, new_state = kda_mixed(self.kda_prefill, q[None], kk[None], v[None], g_THK[None], beta_TH[None], init, batch.cu_seqlens)
            else:
                o, new_state = self.kda_prefill(q[None], kk[None], v[None], g_THK[None], beta_TH[None], None, init, batch.cu_seqlens)
            o_THV = o[0]
        if cache is not None and not in_pool:
            assert batch.state_slots is not None and conv_state is not None
            cache.conv_SCW.index_copy_(0, batch.state_slots, conv_state.to(cache.conv_SCW.dtype))
            cache.state_SHKV.index_copy_(0, batch.state_slots, new_state)

        # norm before the gate, both in fp32 (the gate would otherwise be applied to bf16-rounded values)
        o32 = self.o_norm(o_THV.float()) * torch.sigmoid(gate.view(t, h, k).float())
        return self.o_proj(o32.to(x_TD.dtype).reshape(t, h * k))
