"""The serving layout of an MLA layer on CPU (prepare_for_serving with pack_cpu_weights): a decode step's inputs -- the
fused input projection, q_b(norm(q_a)), the latent [norm(c_kv) | k_pe] written into the pool -- as one call of the
registry's "mla_decode_inputs" (ops/mla/inputs_c.py) instead of ~10 calls; the attention and the output are the layer's
own code. Same code in the same order, so the same bits (tests/serve/test_fused_kda.py runs the engine both ways).

ServedMLA takes the one call only where the separate calls would have run exactly those kernels: a pure decode batch
with a plain fp32 latent pool (an FP8 pool is the layer's own path), a query LoRA, the C panel forms of the projections
and the C norms, no forward hooks, at most PANEL_ROWS sequences, autograd off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from openk3.model.batch import ForwardBatch
from openk3.model.layers import ProjectionGroup
from openk3.model.mla import GatedMLA
from openk3.ops.mla import split_kv_b
from openk3.ops.mla.inputs_c import MLAInputWeights
from openk3.ops.norm import rms_norm_c
from openk3.ops.registry import OpTarget, registry
from openk3.ops.thresholds import PANEL_ROWS
from openk3.serve.panel_copies import group_panels, hooked, kept, linear_panels, tensor_stamp


class ServedMLA(GatedMLA):
    inputs_op: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # the "mla_decode_inputs" C form

    @classmethod
    def from_layer(cls, source: GatedMLA, target: OpTarget) -> ServedMLA:
        """The same module (parameters, hooks and outside references stay), turned into a ServedMLA."""
        source.__class__ = cls
        served = cast(ServedMLA, source)
        served.inputs_op = registry().get("mla_decode_inputs", "fast", target)
        return served

    def forward(self, x_TD: torch.Tensor, batch: ForwardBatch, latent_pool: torch.Tensor | None) -> torch.Tensor:
        page_table = batch.page_table
        plain_pool = latent_pool is not None and latent_pool.dtype == torch.float32 and latent_pool.is_contiguous()
        weights = self.input_weights(x_TD) if batch.is_decode and plain_pool and page_table is not None else None
        if weights is None or latent_pool is None or page_table is None:
            return super().forward(x_TD, batch, latent_pool)
        rows = batch.latent_rows(latent_pool.shape[1], page_table)
        q, proj = self.inputs_op(x_TD, weights, latent_pool.view(-1, latent_pool.shape[2]), rows)
        t = x_TD.shape[0]
        q_nope, q_pe = q.view(t, self.num_heads, -1).split([self.nope, self.rope], dim=-1)
        gate_logits = proj[:, weights.q_a_norm.shape[0] + self.lora + self.rope :] if self.output_gate else None
        w_uk, w_uv = split_kv_b(self.kv_b_proj.weight, self.num_heads, self.nope, self.v_dim)
        out_THV = self.decode(q_nope, q_pe, latent_pool, page_table, batch.context_lens + 1, w_uk, w_uv, self.scale)
        return self.output(out_THV, gate_logits, x_TD.dtype)

    def input_weights(self, x_TD: torch.Tensor) -> MLAInputWeights | None:
        """The inputs' weights with their panel copies when the one call gives what the separate calls would, else None;
        kept while `_stamp` stays the same (as ServedKDA.decode_weights)."""
        rows = x_TD.shape[0] if x_TD.dim() == 2 else 0
        if not 1 <= rows <= PANEL_ROWS or torch.is_grad_enabled() or x_TD.dtype != torch.float32 or not self.q_lora:
            return None
        mods = self._modules
        if hooked(*(cast(nn.Module, mods[n]) for n in ("in_proj", "q_b_proj", "q_a_layernorm", "kv_a_layernorm"))):
            return None
        return kept(self, *self._stamp(), self._find_weights)

    def _stamp(self) -> tuple[tuple | None, list[torch.Tensor]]:
        mods = self._modules
        in_proj, q_b, q_norm, kv_norm = (cast(nn.Module, mods[n]) for n in ("in_proj", "q_b_proj", "q_a_layernorm", "kv_a_layernorm"))
        members: list[nn.Module] = [*cast(ProjectionGroup, in_proj).members, q_b, q_norm, kv_norm]
        tensors = [cast(torch.Tensor, m._parameters["weight"]) for m in members]
        stamp_of = tensor_stamp(tensors)
        if stamp_of is None:
            return None, tensors
        ops = tuple(m.__dict__.get("linear") for m in members) + (q_norm.__dict__.get("norm"), kv_norm.__dict__.get("norm"))
        return (in_proj, q_b, q_norm, kv_norm, ops, stamp_of), tensors

    def _find_weights(self) -> MLAInputWeights | None:
        if self.q_a_layernorm.norm is not rms_norm_c or self.kv_a_layernorm.norm is not rms_norm_c or set(self.in_proj.pieces) != {1}:
            return None
        fused = group_panels(self.in_proj)
        q_b = linear_panels(self.q_b_proj)
        if fused is None or q_b is None:
            return None
        q_norm, kv_norm = self.q_a_layernorm, self.kv_a_layernorm
        return MLAInputWeights(fused[0], q_norm.weight, q_norm.eps, self.q_b_proj.weight, kv_norm.weight, kv_norm.eps, self.lora, self.rope, (fused[1], q_b))
