"""Small building blocks shared by the layers: RMSNorm and the gated (SiLU/SiTU) MLP. Legend: [T, D] packed tokens.

Attribute names match the checkpoint (`weight`, `gate_proj`, `up_proj`, `down_proj`) so state-dict keys need no renaming.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from openk3.config import Activation
from openk3.model.fused import FusedRows
from openk3.ops.activation import glu
from openk3.ops.linear import PackedWeight, linear
from openk3.ops.norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state-dict keys) whose product takes the fastest form for a few rows
    (ops/linear.py); with a bias it is nn.Linear's own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.packed = PackedWeight()

    def pack_weights(self) -> None:
        """Use the weight in oneDNN's blocked layout on CPU above KERNEL_ROWS rows (ops/linear.py); made on first use."""
        self.packed.enable()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if self.bias is not None else linear(x, self.weight, self.packed)


class GatedMLP(nn.Module):
    """down(act(gate(x), up(x))): the dense first-layer MLP and the shared experts."""

    def __init__(self, hidden: int, intermediate: int, act: Activation, situ_beta: float = 4.0, situ_linear_beta: float = 25.0) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.act = act
        self.situ_beta, self.situ_linear_beta = situ_beta, situ_linear_beta
        self.intermediate = intermediate
        self._fused_gate_up = FusedRows()

    def fuse_projections(self) -> None:
        """Store gate|up as one block (model/fused.py)."""
        self._fused_gate_up.tie([self.gate_proj.weight, self.up_proj.weight])

    def pack_weights(self) -> None:
        self._fused_gate_up.pack_weights()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = [self.gate_proj.weight, self.up_proj.weight]
        fused = self._fused_gate_up.rows(weights)
        if fused is not None:  # one matmul for gate and up
            gate, up = linear(x, fused, self._fused_gate_up.packed, weights).split(self.intermediate, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(glu(gate, up, self.act, self.situ_beta, self.situ_linear_beta))
