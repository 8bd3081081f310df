"""Projections at serving step sizes on CPU: x W^T through a C kernel for a few rows, oneDNN (with the weight in its own
blocked layout when the model is served) or MKL for more; and the stacked experts' product computed weight-first.
The registry's "linear" entries (ops/registry.py): `linear_torch` (F.linear; "any"), `linear_cpu` (the CPU forms below;
"cpu") and `linear_c` (the same with the C rows kernel; "c").

Legend: M rows, K input width, N output width; batched: A stacked matrices (experts), C rows each.

Why: at decode step sizes a projection streams its whole weight for a handful of rows, so the step time is how fast the
weight is read. On CPU in fp32 the GEMMs behind F.linear (MKL) and oneDNN's matmul pack or reorder the weight on every call
and read it without prefetching, slowly at few rows, out of cache even more so (the serving case: a decode step's weights do
not fit in the last-level cache). Up to KERNEL_ROWS rows, `ops/cpu/linear.c` reads the weight where it lies, prefetched
into L2, once for all rows: a decode step of the benchmark model 14% faster than with the forms below at 1 and at 16
sequences, 21% at 4 (benchmarks/results/engine_offline.md; op figures in benchmarks/results/ops_linear.md). Where the caller
holds an enabled `PackedWeight` (serving), the kernel reads the weight's panel copy instead (16 outputs side by side per
input, made once): no sums across vector lanes, each weight vector used for all rows in registers; 1.4x on the demo
model's projections at 16 rows, and every output the same in-order sum whatever the row count (issue 42). With the panel
copy the kernel also takes up to PANEL_ROWS rows (ops/thresholds.py), ahead of oneDNN.

Without the "c" backend (no C compiler, OpTarget(c_kernels=False)) and above KERNEL_ROWS: weights of at least
LARGE_WEIGHT elements (512 KiB in fp32) go weight-first, (W x^T)^T, up to SMALL_ROWS rows (1.5-4x F.linear out of cache;
one row is padded to two, or the call becomes a GEMV, as slow as F.linear), then through oneDNN's matmul
(`torch.ops.mkldnn._linear_pointwise`, inference only, the kernel torch's own CPU compiler emits), 1.1-1.8x. Both cost a
few microseconds more per call, which a smaller weight does not earn back: it stays with F.linear. A weight whose caller
holds an enabled `PackedWeight` (the serving engine enables them on CPU) goes to oneDNN in oneDNN's own blocked layout,
made once: given the plain weight, `_linear_pointwise` reorders it on every call (the packed call is 1.4-2x faster at
16-32 rows out of cache, ~4% at prefill sizes). It keeps a second copy of each packed weight in memory, so it is for
serving only. The stacked experts' batched product behaves like the few-row case. Elsewhere (GPU, autograd, bf16) the
registry chooses F.linear, and bmm_weight_t is a plain matmul.

Every path computes the same sums in another order: results agree with F.linear to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from openk3.ops.cpu import cpu_fp32, require_inference
from openk3.ops.cpu.build import kernel
from openk3.ops.thresholds import KERNEL_ROWS, LARGE_WEIGHT, PACKED_BATCH_HINT, PANEL_ROWS, SMALL_ROWS

PANEL = 16  # outputs per panel of ops/cpu/linear.c's packed layout

_onednn = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
_reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None) if _onednn is not None else None


class PackedWeight:
    """Copies of one projection weight in faster layouts for CPU fp32 inference, held by the module that owns the weight
    and made on first use once `enabled` (the serving layout enables them: serve/prepare.py): oneDNN's blocked layout
    (`get`, above the few-row forms) and, where the C kernels run, ops/cpu/linear.c's panels (`panels`, up to PANEL_ROWS
    rows). Each is made only when a call at its row counts comes, so a model serves from one or two extra copies.

    They are caches, so every use checks them against their sources: the weight's address and shape, and the address and
    version counter of every parameter the weight is made of (a fused block's parameters are views whose writes do not show
    in the block's own counter). In-place writes to a parameter -- load_state_dict, `p.copy_` under no_grad, a foreach or
    for-loop optimizer step -- bump its counter, and a new tensor (`.to()`, `p.data = ...`) changes its address: either makes
    the copies be rebuilt. Writes through `p.data` and fused optimizer kernels (`Adam(fused=True)`) bypass the counter; call
    `reset()` after them. Inference tensors (made under torch.inference_mode) have no counter at all, so their weights are
    never packed.
    """

    def __init__(self) -> None:
        self.enabled = False
        self._packed: torch.Tensor | None = None
        self._key: tuple | None = None
        self._panels: torch.Tensor | None = None
        self._panels_key: tuple | None = None

    def __getstate__(self) -> dict[str, Any]:  # copies start empty: oneDNN's opaque tensors do not pickle
        return {"enabled": self.enabled, "_packed": None, "_key": None, "_panels": None, "_panels_key": None}

    def reset(self) -> None:
        self._packed, self._key = None, None
        self._panels, self._panels_key = None, None

    def enable(self) -> None:
        """Use (and, on first use, make) the packed copies from now on; copies held so far are dropped."""
        self.enabled = True
        self.reset()

    def _source_key(self, weight_NK: torch.Tensor, sources: Sequence[torch.Tensor]) -> tuple | None:
        """What a copy was made from, or None when no copy may be used (not enabled, or inference tensors)."""
        if not self.enabled:
            return None
        try:
            versions = tuple((s.data_ptr(), s._version) for s in sources)
        except RuntimeError:  # made under inference mode: no version counter, even once `.data` is a normal tensor
            return None
        return (weight_NK.data_ptr(), tuple(weight_NK.shape), versions)

    def get(self, weight_NK: torch.Tensor, sources: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """oneDNN's blocked copy, or None (not enabled, no oneDNN, inference tensors)."""
        if _reorder is None:
            return None
        key = self._source_key(weight_NK, sources)
        if key is None:
            return None
        if key != self._key:
            self._packed = None  # release the stale copy before making the new one
            self._packed, self._key = _reorder(weight_NK.contiguous(), PACKED_BATCH_HINT), key
        return self._packed

    def panels(self, weight_NK: torch.Tensor, sources: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """ops/cpu/linear.c's panel copy [ceil(N / 16) * 16 * K] of a contiguous fp32 weight, or None (as `get`). Only
        the "c" backend's entry calls it."""
        key = self._source_key(weight_NK, sources)
        if key is None:
            return None
        if key != self._panels_key:
            self._panels = None
            self._panels, self._panels_key = pack_panels(weight_NK), key
        return self._panels


def pack_panels(weight_NK: torch.Tensor) -> torch.Tensor:
    """ops/cpu/linear.c's panel layout of a contiguous fp32 weight [N, K]: [N/16][K][16], the last panel zero-padded."""
    n, k = weight_NK.shape
    out = torch.empty((n + PANEL - 1) // PANEL * PANEL * k, dtype=torch.float32)
    if out.data_ptr() % 64:  # the kernel's vector loads are aligned (torch's CPU allocator aligns to 64 bytes)
        raise RuntimeError(f"pack_panels: the panel buffer at {out.data_ptr():#x} is not 64-byte aligned")
    _pack_kernel()(n, k, weight_NK.data_ptr(), out.data_ptr())
    return out


@functools.cache
def _rows_kernel() -> Any:
    """ops/cpu/linear.c's function, built and loaded once per process (the "c" backend's entry only)."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return kernel("linear.c", "openk3_linear_rows", [i64, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int], None)


@functools.cache
def _panels_kernel() -> Any:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return kernel("linear.c", "openk3_linear_panels", [i64, i64, i64, ptr, i64, ptr, ptr, ctypes.c_int], None)


@functools.cache
def _pack_kernel() -> Any:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return kernel("linear.c", "openk3_pack_panels", [i64, i64, ptr, ptr], None)


def _linear_rows_c(x: torch.Tensor, weight_NK: torch.Tensor, rows: int) -> torch.Tensor:
    width, out_features = weight_NK.shape[1], weight_NK.shape[0]
    x_MK = x.reshape(rows, width)
    if x_MK.stride(1) != 1:
        x_MK = x_MK.contiguous()
    y = x.new_empty(rows, out_features)
    _rows_kernel()(rows, out_features, width, x_MK.data_ptr(), x_MK.stride(0), weight_NK.data_ptr(), y.data_ptr(), torch.get_num_threads())
    return y.view(*x.shape[:-1], out_features)


def _linear_panels_c(x: torch.Tensor, panels: torch.Tensor, out_features: int, rows: int) -> torch.Tensor:
    flat = x.dim() == 2  # the serving case: no reshape or view (each ~1 us, ~55 calls per step)
    x_MK = x if flat else x.reshape(rows, x.shape[-1])
    if x_MK.stride(1) != 1:
        x_MK = x_MK.contiguous()
    y = x.new_empty(rows, out_features)
    _panels_kernel()(rows, out_features, x.shape[-1], x_MK.data_ptr(), x_MK.stride(0), panels.data_ptr(), y.data_ptr(), torch.get_num_threads())
    return y if flat else y.view(*x.shape[:-1], out_features)


def linear_torch(x: torch.Tensor, weight_NK: torch.Tensor, packed: PackedWeight | None = None, sources: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """F.linear (the "any" backend, and the definition): `packed` and `sources` are for the CPU forms, which alone use them."""
    return F.linear(x, weight_NK)


def linear_cpu(
    x: torch.Tensor, weight_NK: torch.Tensor, packed: PackedWeight | None = None, sources: Sequence[torch.Tensor] = (), *, rows_kernel: bool = False
) -> torch.Tensor:
    """x [..., K] @ weight^T -> [..., N], as F.linear(x, weight), in the CPU forms chosen by rows and weight size (module
    docstring); `rows_kernel`: up to KERNEL_ROWS rows through ops/cpu/linear.c (the "c" backend), up to PANEL_ROWS where
    `packed` gives the weight's panel copy. `packed`: the caller's
    PackedWeight for this weight, and `sources` the parameters the weight is made of (default: the weight itself)."""
    require_inference("linear", x, weight_NK)
    if weight_NK.dim() != 2:
        raise ValueError(f"linear: weight shape {tuple(weight_NK.shape)}, expected [N, K]")
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    if rows_kernel and 1 <= rows <= PANEL_ROWS and weight_NK.is_contiguous() and width == weight_NK.shape[1]:
        panels = packed.panels(weight_NK, sources or (weight_NK,)) if packed is not None else None
        if panels is not None:
            return _linear_panels_c(x, panels, weight_NK.shape[0], rows)
        if rows <= KERNEL_ROWS:
            return _linear_rows_c(x, weight_NK, rows)
    if weight_NK.numel() < LARGE_WEIGHT:
        return F.linear(x, weight_NK)
    if 1 <= rows <= SMALL_ROWS:
        x_MK = x.reshape(rows, width)
        if rows == 1:  # a one-column product is a GEMV: two columns keep it a GEMM
            x_MK = torch.cat([x_MK, x_MK])
        y_NM = torch.mm(weight_NK, x_MK.t())
        return y_NM[:, :rows].t().contiguous().view(*x.shape[:-1], weight_NK.shape[0])
    if _onednn is None:  # a torch built without oneDNN: its GEMM is the form left
        return F.linear(x, weight_NK)
    blocked = packed.get(weight_NK, sources or (weight_NK,)) if packed is not None else None
    return _onednn(x, blocked if blocked is not None else weight_NK, None, "none", [], "")


linear_c = functools.partial(linear_cpu, rows_kernel=True)
LinearFn = Callable[..., torch.Tensor]  # (x, weight, packed=None, sources=()) -> x @ weight^T: an entry of "linear"


def bmm_weight_t(x_ACK: torch.Tensor, weight_ANK: torch.Tensor) -> torch.Tensor:
    """x [A, C, K] @ weight^T per matrix -> [A, C, N] (each expert's rows times its own weight)."""
    if not 1 <= x_ACK.shape[1] <= SMALL_ROWS or not cpu_fp32(x_ACK, weight_ANK):  # plain bmm: autograd is fine
        return torch.matmul(x_ACK, weight_ANK.transpose(1, 2))
    return torch.bmm(weight_ANK, x_ACK.transpose(1, 2)).transpose(1, 2).contiguous()
