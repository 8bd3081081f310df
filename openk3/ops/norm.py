"""RMSNorm as a pure function. Legend: [..., N] any leading shape, N the normalised width.

Computed in fp32 and cast back to the input dtype, as every reference (transformers, fla) does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The definition, x / sqrt(mean(x^2) + eps) * weight, spelled out."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """torch's fused rms_norm in fp32: one kernel instead of six (it runs once or twice per sublayer, every step)."""
    y = F.rms_norm(x.float(), (x.shape[-1],), weight.float() if weight is not None else None, eps)
    return y.to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension (KDA's q/k normalisation), fp32 math."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)
