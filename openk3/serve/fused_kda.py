"""The serving layout of a KDA layer on CPU (prepare_for_serving with pack_cpu_weights): a decode step's token, from the
layer's input to o_proj, as one call of the registry's "kda_layer_decode" (ops/kda/layer_c.py) instead of four projection
calls around the fused decode kernel; the same code in the same order, so the same output and states bit for bit
(tests/serve/test_fused_kda.py).

ServedKDA is the same module with a forward that takes the one call only where the separate calls would have run exactly
those kernels: a pure decode batch with a cache, the fused C decode step ("kda_decode" "fused"), a full-rank output gate,
the C panel forms of every projection, and at most PANEL_ROWS sequences. Anything else -- prefill, a speculative
verification, other ops named, more rows, autograd on -- runs the layer's own forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from openk3.model.batch import ForwardBatch
from openk3.model.kda import KDALayerCache, KimiDeltaAttention
from openk3.model.layers import ProjectionGroup, StackedWeights
from openk3.ops.kda.decode_step import KDASlots, kda_decode_step_fused
from openk3.ops.kda.layer_c import KDALayerDecodeWeights
from openk3.ops.registry import OpTarget, registry
from openk3.ops.thresholds import PANEL_ROWS
from openk3.serve.panel_copies import group_panels, hooked, kept, linear_panels, tensor_stamp


class ServedKDA(KimiDeltaAttention):
    layer_decode: Callable[..., torch.Tensor]  # the "kda_layer_decode" C form

    @classmethod
    def from_layer(cls, source: KimiDeltaAttention, target: OpTarget) -> ServedKDA:
        """The same module (parameters, hooks and outside references stay), turned into a ServedKDA."""
        source.__class__ = cls
        served = cast(ServedKDA, source)
        served.layer_decode = registry().get("kda_layer_decode", "fast", target)
        return served

    def forward(self, x_TD: torch.Tensor, batch: ForwardBatch, cache: KDALayerCache | None) -> torch.Tensor:
        weights = self.decode_weights(x_TD) if batch.is_decode and cache is not None else None
        if weights is None or cache is None or batch.state_slots is None:
            return super().forward(x_TD, batch, cache)
        slots = KDASlots(cache.state_SHKV, cache.conv_SCW, batch.state_slots, batch.fresh_seqs, batch.slot_range)
        return self.layer_decode(x_TD, weights, slots)

    def decode_weights(self, x_TD: torch.Tensor) -> KDALayerDecodeWeights | None:
        """The token's weights with their panel copies when the one call gives what the separate calls would, else None.
        Found once and kept while `_stamp` -- the ops chosen, the submodules and every weight's identity, address and
        version -- stays the same (finding them costs ~40 us per layer and step, about what the one call saves)."""
        rows = x_TD.shape[0] if x_TD.dim() == 2 else 0
        if not 1 <= rows <= PANEL_ROWS or torch.is_grad_enabled() or x_TD.dtype != torch.float32 or not self.full_rank_output_gate:
            return None
        mods = self._modules
        if hooked(mods["in_proj"], mods["f_b_proj"], mods["o_proj"]):  # type: ignore[arg-type]
            return None
        return kept(self, *self._stamp(), self._find_weights)

    def _stamp(self) -> tuple[tuple | None, list[torch.Tensor]]:
        """(what the found weights depend on: the submodules, the ops they chose, each weight's identity, address and
        version; None for inference tensors), the weights."""
        mods = self._modules
        in_proj, f_b, o_proj, conv, o_norm = (cast(nn.Module, mods[n]) for n in ("in_proj", "f_b_proj", "o_proj", "conv_weights", "o_norm"))
        members: list[nn.Module] = [*cast(ProjectionGroup, in_proj).members, f_b, o_proj, *cast(StackedWeights, conv).members, o_norm]
        tensors = [cast(torch.Tensor, m._parameters["weight"]) for m in members] + [self.A_log, self.dt_bias]
        stamp_of = tensor_stamp(tensors)
        if stamp_of is None:
            return None, tensors
        ops = tuple(m.__dict__.get("linear") for m in members) + (self.kda_decode, o_norm.__dict__.get("norm"))
        return (in_proj, f_b, o_proj, conv, o_norm, ops, stamp_of), tensors

    def _find_weights(self) -> KDALayerDecodeWeights | None:
        if self.kda_decode is not kda_decode_step_fused or self.in_proj.pieces != (3, 1, 1, 1):
            return None
        fused = group_panels(self.in_proj)
        panels = (fused[1] if fused is not None else None, linear_panels(self.f_b_proj), linear_panels(self.o_proj))
        if fused is None or any(p is None for p in panels):
            return None
        copies = cast(tuple[torch.Tensor, torch.Tensor, torch.Tensor], panels)
        return KDALayerDecodeWeights(fused[0], self.f_b_proj.weight, self.o_proj.weight, self.layer_weights(), self.num_heads, copies)
