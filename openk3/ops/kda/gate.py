"""KDA forget gate: pre-activation f -> per-key-channel log decay g <= 0.

Legend: [...] leading dims (B, T or N), H heads, K key head dim. A_log has H elements ([H], or [1, 1, H, 1] as transformers'
port stores it); dt_bias has H*K elements ([H*K] checkpoints, or [H, K]).

Computed in fp32: g is summed over up to a whole chunk and exponentiated, so bf16 rounding here would compound.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.config import KDAGate


def kda_gate(
    f: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    gate: KDAGate,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """SOFTPLUS: g = -exp(A_log[h]) * softplus(f + dt_bias[h, c]); LOWER_BOUND: g = lb * sigmoid(exp(A_log[h]) * (f + dt_bias[h, c]))."""
    if f.dim() < 2:
        raise ValueError(f"kda_gate: f must be [..., H, K], got shape {tuple(f.shape)}")
    H, K = f.shape[-2], f.shape[-1]
    if A_log.numel() != H:
        raise ValueError(f"kda_gate: A_log has {A_log.numel()} elements (shape {tuple(A_log.shape)}), expected H={H}")
    if dt_bias.numel() != H * K:
        raise ValueError(f"kda_gate: dt_bias has {dt_bias.numel()} elements (shape {tuple(dt_bias.shape)}), expected H*K={H * K}")
    rate = A_log.float().reshape(H, 1).exp()
    x = f.float() + dt_bias.float().reshape(H, K)
    if gate == KDAGate.SOFTPLUS:
        if lower_bound is not None:
            raise ValueError(f"kda_gate: lower_bound={lower_bound!r} given with gate=softplus; it only applies to gate=lower_bound")
        return -rate * F.softplus(x)
    if gate == KDAGate.LOWER_BOUND:
        if lower_bound is None or lower_bound >= 0:
            raise ValueError(f"kda_gate: lower_bound={lower_bound!r} is invalid for gate=lower_bound: expected a negative float")
        return lower_bound * torch.sigmoid(rate * x)
    raise ValueError(f"kda_gate: gate={gate!r} is invalid: expected one of {[g.value for g in KDAGate]}")
