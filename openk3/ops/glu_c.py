"""A gated MLP's activation in one C loop (ops/cpu/glu.c): the "c" backend's "fast" form of "glu" (ops/registry.py), the
activation between a GatedMLP's projections (the shared experts, the dense MLP).

Legend: [..., I] gate and up projections. Same signature as ops/activation.py's glu, the definition; SiLU and SiTU in
fp32 with the kernels' exp and tanh (fastmath.h, glu.h), so it agrees with the torch ops to fp32 rounding
(tests/ops/test_glu_c.py). Gate and up may be strided rows, as the two pieces of one fused projection's output are.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from openk3.config import Activation
from openk3.ops.cpu import require_inference
from openk3.ops.cpu.build import kernel

_ACT_CODES = {Activation.SILU: 0, Activation.SITU: 1}  # glu.h's ACT_SILU, ACT_SITU


@functools.cache
def _kernel() -> Any:
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    return kernel("glu.c", "openk3_glu", [i64, i64, ptr, i64, ptr, i64, ctypes.c_int, f32, f32, ptr], None)


def _rows(t: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    r = t.reshape(rows, width)
    return r if r.stride(1) == 1 and (rows == 1 or r.stride(0) >= width) else r.contiguous()


def glu_c(gate: torch.Tensor, up: torch.Tensor, kind: Activation, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """act(gate, up) [..., I] fp32, as activation.glu (CPU fp32 inference)."""
    if gate.shape != up.shape:
        raise ValueError(f"glu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    code = _ACT_CODES.get(kind)
    if code is None:
        raise ValueError(f"glu: activation {kind!r}, expected one of {sorted(a.value for a in _ACT_CODES)}")
    require_inference("glu", gate, up)
    width = gate.shape[-1] if gate.dim() else 1
    rows = gate.numel() // width if width else 0
    out = torch.empty(gate.shape, dtype=torch.float32)
    if rows == 0:
        return out
    g, u = _rows(gate, rows, width), _rows(up, rows, width)
    _kernel()(rows, width, g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), code, beta, linear_beta, out.data_ptr())
    return out
