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

from openk3.model.batch import ForwardBatch
from openk3.model.kda import KDALayerCache, KimiDeltaAttention
from openk3.ops.kda.decode_step import KDASlots, kda_decode_step_fused
from openk3.ops.kda.layer_c import KDALayerDecodeWeights
from openk3.ops.registry import OpTarget, registry
from openk3.ops.thresholds import PANEL_ROWS
from openk3.serve.panel_copies import group_panels, linear_panels


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
        """The token's weights with their panel copies when the one call gives what the separate calls would, else None."""
        rows = x_TD.shape[0] if x_TD.dim() == 2 else 0
        if not 1 <= rows <= PANEL_ROWS or torch.is_grad_enabled() or x_TD.dtype != torch.float32 or not self.full_rank_output_gate:
            return None
        if self.kda_decode is not kda_decode_step_fused or self.in_proj.pieces != (3, 1, 1, 1):
            return None
        fused = group_panels(self.in_proj)
        panels = (fused[1] if fused is not None else None, linear_panels(self.f_b_proj), linear_panels(self.o_proj))
        if fused is None or any(p is None for p in panels):
            return None
        copies = cast(tuple[torch.Tensor, torch.Tensor, torch.Tensor], panels)
        return KDALayerDecodeWeights(fused[0], self.f_b_proj.weight, self.o_proj.weight, self.layer_weights(), self.num_heads, copies)
