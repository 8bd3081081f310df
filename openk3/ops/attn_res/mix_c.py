"""Attention Residuals' one-shot mix in one C call (ops/cpu/attn_res.c), and the residual stream that reads through it: the
"c" backend's "sized" form of "attn_res" (ops/registry.py) for CPU fp32 inference.

Legend: S sources (the stored blocks followed by the current partial sum), N tokens, D hidden width.

Why: a decode step reads every sublayer's input through the mix (16 reads per step on the demo model); the one-shot torch
form stacks the sources and runs ~10 small ops over them, 0.1 ms per read at 16 tokens, about a tenth of a batch-16 step
(issue 42's profile). The C loop reads the sources where they lie. Same math as naive.attn_res; sums in another order,
so it agrees to fp32 rounding (tests/ops/test_attn_res_c.py). Steps of TWO_PHASE_MIN_TOKENS tokens and more take the
two-phase stream, as "sized" does on the other backends.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Any

import torch

from openk3.ops.attn_res.naive import OneShotStream, check_query
from openk3.ops.attn_res.stream import DepthStream, MixQuery
from openk3.ops.attn_res.two_phase import TwoPhaseStream
from openk3.ops.cpu import require_inference
from openk3.ops.cpu.build import kernel
from openk3.ops.thresholds import TWO_PHASE_MIN_TOKENS

MAX_SOURCES = 64  # the C loop keeps a token's logits on the stack


@functools.cache
def _kernel() -> Any:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return kernel("attn_res.c", "openk3_attn_res_mix", [i64, i64, i64, ptr, ptr, ptr, ptr, ctypes.c_float, ptr, ctypes.c_int], ctypes.c_int)


def attn_res_c(sources: Sequence[torch.Tensor], query_D: torch.Tensor, norm_weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """naive.attn_res(torch.stack(sources), ...) for fp32 CPU rows [N, D] each, without the stack; returns [N, D] fp32."""
    if not 1 <= len(sources) <= MAX_SOURCES:
        raise ValueError(f"attn_res_c: {len(sources)} sources, the C loop takes 1..{MAX_SOURCES}")
    shape = sources[0].shape
    if len(shape) != 2 or any(s.shape != shape for s in sources):
        raise ValueError(f"attn_res_c: sources of shapes {sorted({tuple(s.shape) for s in sources})}, expected one [N, D] shape")
    check_query("c", query_D, norm_weight_D, shape[1])
    rows = [s if s.stride(-1) == 1 else s.contiguous() for s in sources]
    w, gamma = query_D.contiguous(), norm_weight_D.contiguous()
    require_inference("attn_res", *rows, w, gamma)
    out = torch.empty(shape, dtype=torch.float32)
    count = len(rows)
    addresses = (ctypes.c_int64 * count)(*(r.data_ptr() for r in rows))
    strides = (ctypes.c_int64 * count)(*(r.stride(0) for r in rows))
    _kernel()(count, shape[0], shape[1], addresses, strides, w.data_ptr(), gamma.data_ptr(), eps, out.data_ptr(), torch.get_num_threads())
    return out


class OneShotStreamC(OneShotStream):
    """OneShotStream whose reads mix in C (the sources stay a list: nothing is stacked).

    A read goes straight to the kernel, with the sources' addresses kept in the stream (a block's written once, the
    partial sum's at each read), where every source is a plain row block -- fp32 CPU rows [N, D] of one shape, unit
    column stride, checked once when it enters the stream -- and the mixer's query and norm weight are contiguous fp32 CPU
    [D] with autograd off; anything else takes attn_res_c and its checks. The same kernel call either way: the same bits.
    Why: attn_res_c's checks and argument building cost ~2x its kernel at 16 rows of 256, for 16 reads per decode step.
    """

    def __init__(self, embed_TD: torch.Tensor) -> None:
        super().__init__(embed_TD)
        self._shape = embed_TD.shape
        self._plain = _plain_rows(embed_TD, self._shape)  # every source so far is a plain row block
        self._addresses = (ctypes.c_int64 * MAX_SOURCES)()
        self._strides = (ctypes.c_int64 * MAX_SOURCES)()

    def start_block(self, readers: Sequence[MixQuery]) -> None:
        super().start_block(readers)
        i = len(self._blocks) - 1
        if i < MAX_SOURCES:
            block = self._blocks[i]
            self._addresses[i], self._strides[i] = block.data_ptr(), block.stride(0)

    def add(self, out_TD: torch.Tensor) -> None:
        super().add(out_TD)
        if self._plain and self._partial is not None:
            self._plain = _plain_rows(self._partial, self._shape)

    def read(self, mixer: MixQuery | None) -> torch.Tensor:
        partial, count = self._partial, len(self._blocks) + (self._partial is not None)
        if self._plain and mixer is not None and 2 <= count <= MAX_SOURCES and not torch.is_grad_enabled():
            q, gamma, width = mixer.query_D, mixer.norm_weight_D, self._shape[1]
            if _plain_vector(q, width) and _plain_vector(gamma, width):
                if partial is not None:
                    self._addresses[count - 1], self._strides[count - 1] = partial.data_ptr(), partial.stride(0)
                out = torch.empty(self._shape, dtype=torch.float32)
                _kernel()(
                    count,
                    self._shape[0],
                    width,
                    self._addresses,
                    self._strides,
                    q.data_ptr(),
                    gamma.data_ptr(),
                    mixer.eps,
                    out.data_ptr(),
                    torch.get_num_threads(),
                )
                return out
        sources = self._blocks if partial is None else [*self._blocks, partial]
        if len(sources) == 1:
            return sources[0]
        assert mixer is not None, "an AttnRes read names its mixer"
        return attn_res_c(sources, mixer.query_D, mixer.norm_weight_D, mixer.eps)


def _plain_rows(x: torch.Tensor, shape: torch.Size) -> bool:
    """fp32 CPU rows of `shape` ([N, D]) with unit column stride and no autograd history to keep: what the kernel reads as is."""
    return x.shape == shape and len(shape) == 2 and x.stride(1) == 1 and x.dtype is torch.float32 and x.is_cpu and not x.requires_grad


def _plain_vector(v: torch.Tensor, width: int) -> bool:
    return v.dtype is torch.float32 and v.is_cpu and v.dim() == 1 and v.shape[0] == width and v.stride(0) == 1


def attn_res_sized_c(embed_TD: torch.Tensor) -> DepthStream:
    """attn_res_sized with the one-shot reads in C (decode-sized steps)."""
    if embed_TD.shape[0] >= TWO_PHASE_MIN_TOKENS:
        return TwoPhaseStream(embed_TD)
    return OneShotStreamC(embed_TD)
