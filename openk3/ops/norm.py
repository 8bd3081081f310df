"""RMSNorm as a pure function. Legend: [..., N] any leading shape, N the normalised width.

Computed in fp32 and cast back to the input dtype, as every reference (transformers, fla) does.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
import torch.nn.functional as F

from openk3.ops.cpu import cpu_fp32_inference
from openk3.ops.cpu.build import bind


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The definition, x / sqrt(mean(x^2) + eps) * weight, spelled out."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """torch's fused rms_norm in fp32, or on CPU at inference the C kernel of ops/cpu/norm.c (it runs once or twice per
    sublayer, every step, and the composite op's dispatch outweighs its arithmetic at decode sizes)."""
    out = _rms_norm_cpu(x, weight, eps)
    if out is not None:
        return out
    y = F.rms_norm(x.float(), (x.shape[-1],), weight.float() if weight is not None else None, eps)
    return y.to(x.dtype)


@functools.cache
def _kernel() -> Any:
    """The ctypes function of ops/cpu/norm.c, loaded once per process; None when it cannot be built or is switched off."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return bind("norm.c", "openk3_rms_norm", [i64, i64, ptr, i64, ptr, ctypes.c_float, ptr], None)


def _rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor | None:
    tensors = (x,) if weight is None else (x, weight)
    if not cpu_fp32_inference(*tensors):  # first, so that other devices never build the kernel
        return None
    kernel = _kernel()
    if kernel is None or x.dim() < 1 or x.stride(-1) != 1 or (weight is not None and (not weight.is_contiguous() or weight.numel() != x.shape[-1])):
        return None
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    x2 = x.reshape(rows, width) if rows else x
    if rows == 0 or (rows > 1 and x2.stride(0) < width):  # reshape could not keep rows apart: leave it to torch
        return None
    out = torch.empty(x.shape, dtype=torch.float32)
    kernel(rows, width, x2.data_ptr(), x2.stride(0), weight.data_ptr() if weight is not None else None, eps, out.data_ptr())
    return out


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension (KDA's q/k normalisation), fp32 math."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)
