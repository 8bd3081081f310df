"""Gated MLP activations: SiLU-GLU (Kimi Linear) and SiTU-GLU (K3). Legend: [..., I] gate and up projections.

SiTU bounds both branches (gate' = beta tanh(g/beta) sigmoid(g), up' = beta_lin tanh(u/beta_lin)), so |h| <= beta * beta_lin;
it is evaluated in fp32 because tanh saturation in bf16 loses the small-signal slope.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.config import Activation


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    g32, u32 = gate.float(), up.float()
    gate_act = beta * torch.tanh(g32 / beta) * torch.sigmoid(g32)
    up_act = linear_beta * torch.tanh(u32 / linear_beta)
    return (gate_act * up_act).to(gate.dtype)


def glu(gate: torch.Tensor, up: torch.Tensor, kind: Activation, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    if kind == Activation.SITU:
        return situ_glu(gate, up, beta, linear_beta)
    return silu_glu(gate, up)
