"""Weights of the same input stored as row blocks of one tensor (the serving layout of a ProjectionGroup or StackedWeights,
serve/prepare.py), so that inference runs one matmul where the checkpoint has several (q|k|v|f_a|g|b in KDA, q|kv_a|g in
MLA, gate|up in the MLPs) without a second copy of the weights.

Why: at serving step sizes a matmul over a few rows costs more in dispatch than in arithmetic, so six small projections of
the same input cost several times one projection of their concatenation.

`FusedRows.tie(params)` concatenates the parameters once and re-points each one (`p.data`) at its block of the result. The
parameters keep their names, identities and gradients, and every in-place write -- load_state_dict, an optimizer step
(fused or not), `.data.copy_` -- lands in the fused tensor as well: the block is no cache that could go stale. (Its
optional oneDNN-layout copy for CPU serving, `packed`, is one; it checks the parameters' addresses and version counters on
every use, see ops/linear.py.) `rows(params)` hands the fused tensor out only while autograd is off (training
differentiates the parameters, not the block) and while every parameter still sits at its place in it; whatever gives a
parameter new storage (`.to()`, cast_model, `p.data = ...`, `torch.func.functional_call`) makes it return None and the layer
falls back to one matmul per parameter -- slower, never wrong -- and the block is released. prepare_for_serving ties again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from openk3.ops.linear import PackedWeight


class FusedRows:
    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None
        self._layout: list[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]] = []
        self.packed = PackedWeight()  # the block in oneDNN's layout for CPU serving (ops/linear.py), when enabled

    def __getstate__(self) -> dict:
        # A copy (deepcopy, pickling to a spawned worker) gets its parameters as separate tensors; it starts untied rather
        # than carry a block nothing points into. prepare_for_serving ties it again.
        return {"tensor": None, "_layout": [], "packed": self.packed}

    @staticmethod
    def _where(block: torch.Tensor, params: Sequence[torch.Tensor]) -> list[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]]:
        # Addresses relative to the block, so that moving the whole block's storage (share_memory_) keeps it intact; the block
        # is held, so its memory cannot be reused by another tensor meanwhile.
        base = block.data_ptr()
        return [(p.data_ptr() - base, p.shape, p.stride(), p.dtype) for p in params]

    def tie(self, params: Sequence[torch.Tensor]) -> None:
        """Concatenate `params` along dim 0 and make each a view of its rows (no extra memory once the old storage is freed).
        A group already tied stays as it is (share_memory, a no-op .to()); one whose dtypes or devices differ is left untied
        (concatenating would silently convert some of them)."""
        if self.intact(params) or len({(p.dtype, p.device) for p in params}) != 1:
            return
        # outside inference mode, so that a model loaded under it can still be trained after serving
        with torch.inference_mode(False), torch.no_grad():
            fused = torch.cat([p.detach().clone() if p.is_inference() else p.detach() for p in params], dim=0)
            start = 0
            for p in params:
                p.data = fused[start : start + p.shape[0]]
                start += p.shape[0]
        self.tensor, self._layout = fused, self._where(fused, params)

    def intact(self, params: Sequence[torch.Tensor]) -> bool:
        """Every parameter is still the view of its rows of the block (same address, shape, strides and dtype as at tie)."""
        return self.tensor is not None and self._where(self.tensor, params) == self._layout

    def rows(self, params: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """The fused tensor if it may stand in for `params` now, else None (see the module docstring). A block its
        parameters have left is released, so no dead copy of the weights stays alive."""
        if self.tensor is None or torch.is_grad_enabled():
            return None
        if not self.intact(params):
            self.release()
            return None
        return self.tensor

    def release(self) -> None:
        """Forget the block (and its packed copy): the parameters keep whatever storage they have now."""
        self.tensor, self._layout = None, []
        self.packed.reset()
