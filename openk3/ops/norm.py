"""RMSNorm as a pure function. Legend: [..., N] any leading shape, N the normalised width.

Computed in fp32 and cast back to the input dtype, as every reference (transformers, fla) does. The registry's "rms_norm"
entries: `rms_norm_reference` ("naive"), `rms_norm` ("fast" anywhere), `rms_norm_c` ("fast" on the "c" backend; its
result stays fp32, which is what the fp32 inference it is chosen for has).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
import torch.nn.functional as F

from openk3.ops.cpu import require_inference
from openk3.ops.cpu.build import kernel


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The definition, x / sqrt(mean(x^2) + eps) * weight, spelled out."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """torch's fused rms_norm in fp32 (the "any" backend's "fast")."""
    y = F.rms_norm(x.float(), (x.shape[-1],), weight.float() if weight is not None else None, eps)
    return y.to(x.dtype)


@functools.cache
def _kernel() -> Any:
    """The ctypes function of ops/cpu/norm.c, loaded once per process (the "c" backend's entry only)."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return kernel("norm.c", "openk3_rms_norm", [i64, i64, ptr, i64, ptr, ctypes.c_float, ptr], None)


def rms_norm_c(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """rms_norm through the C kernel of ops/cpu/norm.c (the "c" backend): it runs once or twice per sublayer, every step,
    and the composite op's dispatch outweighs its arithmetic at decode sizes. Rows may be strided; a row that is not
    contiguous, or rows a reshape cannot keep apart, are copied first."""
    require_inference("rms_norm", x, *(() if weight is None else (weight,)))
    width = x.shape[-1] if x.dim() else 0
    if weight is not None and weight.numel() != width:
        raise ValueError(f"rms_norm: weight of {weight.numel()} values for rows of width {width}")
    rows = x.numel() // width if width else 0
    if rows == 0:
        return torch.empty(x.shape, dtype=torch.float32)
    x2 = x.reshape(rows, width)
    if x2.stride(1) != 1 or (rows > 1 and x2.stride(0) < width):
        x2 = x2.contiguous()
    w = weight.contiguous() if weight is not None else None
    out = torch.empty(x.shape, dtype=torch.float32)
    _kernel()(rows, width, x2.data_ptr(), x2.stride(0), w.data_ptr() if w is not None else None, eps, out.data_ptr())
    return out


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension (KDA's q/k normalisation), fp32 math."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)
