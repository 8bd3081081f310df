"""Concatenated projection weights for inference: one matmul where the checkpoint has several (q|k|v|f_a|g_a|b, gate|up).

Why: at serving step sizes on CPU (and at decode on any device) a matmul over a handful of rows costs more in dispatch than
in arithmetic, so six small projections of the same input cost several times one projection of the concatenated weight.
The checkpoint keeps the weights separate (their names are the official ones), so the concatenation is a cache:

- it is rebuilt whenever one of its sources changes: the key is each source tensor (held, so its identity cannot be reused),
  its in-place version counter, storage pointer and dtype, so `load_state_dict`, `copy_` under no_grad, an optimizer step or `.to(dtype)` all
  invalidate it (writes through `.data` bypass the version counter: call `clear()` after those);
- it is only used when autograd is not recording (`use_fused()`), so training always goes through the separate parameters
  and their gradients.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def use_fused() -> bool:
    """True when a derived (cached) weight may stand in for the parameters: inference_mode or no_grad."""
    return not torch.is_grad_enabled()


class ConcatCache:
    """torch.cat(sources, dim) kept until a source changes."""

    def __init__(self, dim: int = 0) -> None:
        self.dim = dim
        self._sources: tuple[torch.Tensor, ...] = ()
        self._versions: tuple[tuple[int, int, torch.dtype], ...] = ()
        self._value: torch.Tensor | None = None

    def get(self, sources: Sequence[torch.Tensor]) -> torch.Tensor:
        # the storage pointer and dtype catch `p.data = ...` swaps (cast_model), which keep the Parameter object
        versions = tuple((t._version, t.data_ptr(), t.dtype) for t in sources)
        same = len(sources) == len(self._sources) and all(a is b for a, b in zip(sources, self._sources, strict=True))
        if self._value is None or not same or versions != self._versions:
            with torch.no_grad():
                self._value = torch.cat([t.detach() for t in sources], dim=self.dim)
            self._sources, self._versions = tuple(sources), versions
        return self._value

    def clear(self) -> None:
        self._sources, self._versions, self._value = (), (), None
