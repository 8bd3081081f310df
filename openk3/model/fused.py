"""Projections of the same input stored as row blocks of one tensor, so that inference runs one matmul where the checkpoint
has several (q|k|v|f_a|g|b in KDA, q|kv_a|g in MLA, gate|up in the MLPs), without a second copy of the weights.

Why: at serving step sizes a matmul over a few rows costs more in dispatch than in arithmetic, so six small projections of
the same input cost several times one projection of their concatenation.

`FusedRows.tie(params)` concatenates the parameters once and re-points each one (`p.data`) at its block of the result. The
parameters keep their names, identities and gradients, and every in-place write -- load_state_dict, an optimizer step
(fused or not), `.data.copy_` -- lands in the fused tensor as well: there is no cache to go stale. `rows(params)` hands the
fused tensor out only while autograd is off (training differentiates the parameters, not the block) and while every
parameter still sits at its place in it; whatever gives a parameter new storage (`.to()`, cast_model, `p.data = ...`,
`torch.func.functional_call`) makes it return None and the layer falls back to one matmul per parameter -- slower, never
wrong. The serving engine ties a model once it is loaded and placed (`K3ForCausalLM.fuse_projections`); a tied model re-ties
itself after `.to()` / `.float()` / `.cuda()` and after cast_model, so the old block is not kept alive; training never ties.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class FusedRows:
    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None

    def __getstate__(self) -> dict:
        # A copy (deepcopy, pickling to a spawned worker) gets its parameters as separate tensors; it starts untied rather
        # than carry a block nothing points into. Calling fuse_projections() on it ties it again.
        return {"tensor": None}

    def tie(self, params: Sequence[torch.Tensor]) -> None:
        """Concatenate `params` along dim 0 and make each a view of its rows (no extra memory once the old storage is freed)."""
        # outside inference mode, so that a model loaded under it can still be trained after serving
        with torch.inference_mode(False), torch.no_grad():
            fused = torch.cat([p.detach().clone() if p.is_inference() else p.detach() for p in params], dim=0)
            start = 0
            for p in params:
                p.data = fused[start : start + p.shape[0]]
                start += p.shape[0]
        self.tensor = fused

    def rows(self, params: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The fused tensor if it may stand in for `params` now, else None (see the module docstring)."""
        fused = self.tensor
        if fused is None or torch.is_grad_enabled():
            return None
        storage, offset, row = fused.untyped_storage().data_ptr(), fused.storage_offset(), fused.stride(0)
        for p in params:
            if p.dtype != fused.dtype or p.untyped_storage().data_ptr() != storage or p.storage_offset() != offset:
                return None
            offset += p.shape[0] * row
        return fused
