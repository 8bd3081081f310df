"""The KDA decode step of a layer, from its input projections to the normalised, gated output: one signature, four forms
("kda_decode" in ops/registry.py, whose "auto" rule pairs them with the prefill form and the head size).

Legend: N sequences (one token each), H heads, K = V head dim, P = H * K, C = 3P (q | k | v before the conv), W conv width,
S pool slots. Every form takes (qkv_NC, f_NP, b_NH, out_gate_NP, weights, slots) and returns o [N, P] fp32, having
advanced the slots' conv windows and recurrent states in the pools by one token:
- kda_decode_step_naive: the definitions' order on gathered slots (old state in, new state out, written back); differentiable;
- kda_decode_step_in_pool: conv windows and states advanced where they live, torch ops (decode_inplace.py says why);
- kda_decode_step_fused: the whole step in one C call (decode_fused.py), CPU fp32 inference, head dims up to MAX_HEAD_DIM;
- kda_decode_step_fla: fla's fused recurrence over N one-token sequences (fla_kernels.py), states gathered, CUDA.

Sequences that start fresh (no context yet) read zeros whatever their slot holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from openk3.config import KDAGate
from openk3.ops.kda.decode import kda_decode
from openk3.ops.kda.decode_fused import kda_decode_fused
from openk3.ops.kda.decode_inplace import kda_decode_
from openk3.ops.kda.fla_kernels import kda_recurrent_fla
from openk3.ops.kda.gate import kda_gate
from openk3.ops.kda.inference_only import refuse_autograd
from openk3.ops.norm import l2_norm
from openk3.ops.short_conv import causal_conv1d_update, causal_conv1d_update_


class KDALayerWeights(NamedTuple):
    """What a KDA step reads of its layer besides the projections (prefill and decode alike)."""

    conv_weight_CW: torch.Tensor  # [3P, W]: the q | k | v depthwise kernels stacked, as the conv windows are
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    gate: KDAGate
    gate_lower_bound: float | None
    output_norm: Callable[[torch.Tensor], torch.Tensor]  # the layer's o_norm as chosen (rms_norm), fp32 in and out
    norm_weight_D: torch.Tensor  # its weight and eps, for the fused kernel, which normalises in C
    norm_eps: float


class KDASlots(NamedTuple):
    """Where the step's sequences keep their state (model/batch.py's cache contract)."""

    state_SHKV: torch.Tensor  # fp32 recurrent states, one per slot
    conv_SCW: torch.Tensor  # conv windows (the last W-1 pre-conv inputs of q | k | v)
    slots_N: torch.Tensor  # int64 slot per sequence
    fresh_N: torch.Tensor | None  # bool, True where a sequence has no context yet (None: none is fresh)
    slot_range: tuple[int, int] | None  # (first, end) when the slots are consecutive ascending ids


KDADecodeStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, KDALayerWeights, KDASlots], torch.Tensor]


def gather_slots(pool: torch.Tensor, slots_N: torch.Tensor, fresh_N: torch.Tensor | None) -> torch.Tensor:
    """The slots' contents (a copy), with fresh sequences reading zeros whatever the slot holds."""
    states = pool.index_select(0, slots_N)
    if fresh_N is None:
        return states
    return states.masked_fill(fresh_N.view(-1, *([1] * (states.dim() - 1))), 0.0)


def _advance_in_pool(pool: torch.Tensor, slots: KDASlots, step: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Run `step` (which advances the states it is given in place) on the slots where they live: through a slice of the pool
    when the slots are consecutive, else on a gathered copy that is written back."""
    if slots.slot_range is None:
        states = gather_slots(pool, slots.slots_N, slots.fresh_N)
        out = step(states)
        pool.index_copy_(0, slots.slots_N, states)
        return out
    states = pool[slots.slot_range[0] : slots.slot_range[1]]
    if slots.fresh_N is not None:
        states.masked_fill_(slots.fresh_N.view(-1, *([1] * (states.dim() - 1))), 0.0)
    return step(states)


def delta_rule_inputs(
    qkv_NC: torch.Tensor, f_NP: torch.Tensor, b_NH: torch.Tensor, weights: KDALayerWeights, heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v [N, H, K], g [N, H, K] log decay, beta [N, H]) from the conv output."""
    n = qkv_NC.shape[0]
    qkv = qkv_NC.view(n, 3, heads, -1)
    q, k = l2_norm(qkv[:, :2]).unbind(1)  # q and k normalised in one pass
    g = kda_gate(f_NP.view(n, heads, -1), weights.A_log, weights.dt_bias, weights.gate, weights.gate_lower_bound)
    return q, k, qkv[:, 2], g, torch.sigmoid(b_NH.float())


def gated_output(o_NHV: torch.Tensor, out_gate_NP: torch.Tensor, output_norm: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """o_norm(o) * sigmoid(gate) [N, P] fp32: norm before the gate, both in fp32 (else the gate meets bf16-rounded values)."""
    n, h, v = o_NHV.shape
    return (output_norm(o_NHV.float()) * torch.sigmoid(out_gate_NP.view(n, h, v).float())).reshape(n, h * v)


def _gathered_step(
    recurrence: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    qkv_NC: torch.Tensor,
    f_NP: torch.Tensor,
    b_NH: torch.Tensor,
    out_gate_NP: torch.Tensor,
    weights: KDALayerWeights,
    slots: KDASlots,
) -> torch.Tensor:
    """The step on gathered copies of the slots, `recurrence` (q, k, v, g, beta, state) -> (o, new state); both new states
    written back after it (the old ones stay intact until then)."""
    conv_in = gather_slots(slots.conv_SCW, slots.slots_N, slots.fresh_N)
    x, conv_state = causal_conv1d_update(qkv_NC, weights.conv_weight_CW, conv_in, activation="silu")
    q, k, v, g, beta = delta_rule_inputs(x, f_NP, b_NH, weights, slots.state_SHKV.shape[1])
    o, new_state = recurrence(q, k, v, g, beta, gather_slots(slots.state_SHKV, slots.slots_N, slots.fresh_N))
    slots.conv_SCW.index_copy_(0, slots.slots_N, conv_state.to(slots.conv_SCW.dtype))
    slots.state_SHKV.index_copy_(0, slots.slots_N, new_state)
    return gated_output(o, out_gate_NP, weights.output_norm)


def kda_decode_step_naive(
    qkv_NC: torch.Tensor, f_NP: torch.Tensor, b_NH: torch.Tensor, out_gate_NP: torch.Tensor, weights: KDALayerWeights, slots: KDASlots
) -> torch.Tensor:
    """The reference: conv update and kda_decode in the definition's order (the order every form is checked in)."""
    return _gathered_step(kda_decode, qkv_NC, f_NP, b_NH, out_gate_NP, weights, slots)


def _fla_one_token_each(q, k, v, g, beta, state):  # type: ignore[no-untyped-def]  # the recurrence's own signature
    one_each = torch.arange(q.shape[0] + 1, dtype=torch.int64, device=q.device)
    o, new_state = kda_recurrent_fla(q[None], k[None], v[None], g[None], beta[None], None, state, one_each)
    return o[0], new_state


def kda_decode_step_fla(
    qkv_NC: torch.Tensor, f_NP: torch.Tensor, b_NH: torch.Tensor, out_gate_NP: torch.Tensor, weights: KDALayerWeights, slots: KDASlots
) -> torch.Tensor:
    """fla's fused_recurrent_kda over N one-token sequences of one varlen call, on gathered states."""
    refuse_autograd("fla", qkv_NC)
    return _gathered_step(_fla_one_token_each, qkv_NC, f_NP, b_NH, out_gate_NP, weights, slots)


def kda_decode_step_in_pool(
    qkv_NC: torch.Tensor, f_NP: torch.Tensor, b_NH: torch.Tensor, out_gate_NP: torch.Tensor, weights: KDALayerWeights, slots: KDASlots
) -> torch.Tensor:
    """Conv windows and states advanced in place in the pools: no gather and scatter when the slots are consecutive."""
    refuse_autograd("in_pool", qkv_NC)
    conv_weight = weights.conv_weight_CW
    x = _advance_in_pool(slots.conv_SCW, slots, lambda window: causal_conv1d_update_(qkv_NC, conv_weight, window, "silu"))
    q, k, v, g, beta = delta_rule_inputs(x, f_NP, b_NH, weights, slots.state_SHKV.shape[1])
    o = _advance_in_pool(slots.state_SHKV, slots, lambda state: kda_decode_(q, k, v, g, beta, state))
    return gated_output(o, out_gate_NP, weights.output_norm)


def kda_decode_step_fused(
    qkv_NC: torch.Tensor, f_NP: torch.Tensor, b_NH: torch.Tensor, out_gate_NP: torch.Tensor, weights: KDALayerWeights, slots: KDASlots
) -> torch.Tensor:
    """The whole step in one C call, through the slot ids (CPU fp32 inference; the kernel refuses anything else)."""
    refuse_autograd("fused", qkv_NC)
    w = weights
    return kda_decode_fused(
        qkv_NC, w.conv_weight_CW, slots.conv_SCW, slots.slots_N, slots.fresh_N, f_NP, w.A_log, w.dt_bias, b_NH,
        slots.state_SHKV, w.gate, w.gate_lower_bound, w.norm_weight_D, w.norm_eps, out_gate_NP,
    )  # fmt: skip
