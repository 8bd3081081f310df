"""The index of each row's largest value: the registry's "argmax_rows" -- `argmax_rows` (torch.argmax over the last
dimension, the definition) and `argmax_rows_c` (ops/cpu/argmax.c, the "c" backend's "fast" form), which the sampler takes
for its greedy rows (serve/sampler.py).

Legend: M rows, V values per row (the vocabulary). Ties go to the first index and a NaN counts as the largest value (the
first NaN wins), as torch.argmax decides them: the two forms give the same indices (tests/ops/test_argmax_c.py).

Why: torch's CPU argmax over [16, 4096] fp32 took ~100 us in this torch build against ~7 us for its max reduction (issue
42's profile of a batch-16 decode step); torch.max's indices would be faster but are documented to pick any of equal maxima.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from openk3.ops.cpu import require_inference
from openk3.ops.cpu.build import kernel


def argmax_rows(logits_MV: torch.Tensor) -> torch.Tensor:
    """[M] int64: each row's argmax (torch.argmax(-1))."""
    return logits_MV.argmax(-1)


@functools.cache
def _kernel() -> Any:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return kernel("argmax.c", "openk3_argmax_rows", [i64, i64, ptr, i64, ptr], None)


def argmax_rows_c(logits_MV: torch.Tensor) -> torch.Tensor:
    """argmax_rows of fp32 CPU rows [M, V] (V >= 1) in one C loop."""
    if logits_MV.dim() != 2 or logits_MV.shape[1] < 1:
        raise ValueError(f"argmax_rows_c: logits of shape {tuple(logits_MV.shape)}, expected [M, V] with V >= 1")
    require_inference("argmax_rows", logits_MV)
    rows = logits_MV if logits_MV.stride(1) == 1 else logits_MV.contiguous()
    out = torch.empty(rows.shape[0], dtype=torch.int64)
    if rows.shape[0]:
        _kernel()(rows.shape[0], rows.shape[1], rows.data_ptr(), rows.stride(0), out.data_ptr())
    return out
