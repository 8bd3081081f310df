"""Small building blocks shared by the layers: RMSNorm, Linear, the gated (SiLU/SiTU) MLP, and the two places where a
serving layout attaches (ProjectionGroup, StackedWeights). Legend: [T, D] packed tokens, N output width.

Attribute names match the checkpoint (`weight`, `gate_proj`, `up_proj`, `down_proj`) so state-dict keys need no renaming.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from openk3.config import Activation
from openk3.ops.registry import OpTarget, op


class RMSNorm(nn.Module):
    """The norm by the registry's "rms_norm" ("auto" resolved for inference where the weight was made, until the model
    selects again: K3ForCausalLM.select_ops)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.select(OpTarget(self.weight.device.type, dtype=self.weight.dtype))

    def select(self, target: OpTarget, impl: str = "auto") -> None:
        self.norm = op("rms_norm", impl, target)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.weight, self.eps)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same state-dict keys) whose bias-free product is the registry's "linear" (the fastest
    form for a few rows on CPU: ops/linear.py); with a bias it is nn.Linear's own."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: torch.device | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self.select(OpTarget(self.weight.device.type, dtype=self.weight.dtype))

    def select(self, target: OpTarget, impl: str = "auto") -> None:
        self.linear = op("linear", impl, target)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if self.bias is not None else self.linear(x, self.weight)


class ProjectionGroup(nn.Module):
    """Projections of the same input, returned as `pieces` (consecutive members whose outputs come side by side; one piece
    per member by default): here one matmul per member. The members stay registered where the checkpoint names them (this
    module holds them by reference and owns no parameter); a serving layout swaps in a module that stores them as one
    block and runs one matmul whose output pieces are views (serve/prepare.py)."""

    def __init__(self, members: Sequence[Linear], pieces: Sequence[int] | None = None) -> None:
        super().__init__()
        self.members = tuple(members)  # a tuple, so nn.Module does not register them a second time
        self.pieces = tuple(pieces) if pieces is not None else (1,) * len(self.members)
        if sum(self.pieces) != len(self.members) or min(self.pieces) < 1:
            raise ValueError(f"ProjectionGroup: pieces={self.pieces} must split the {len(self.members)} members into non-empty runs")

    @property
    def widths(self) -> list[int]:
        """Output width of each piece."""
        out, start = [], 0
        for n in self.pieces:
            out.append(sum(m.out_features for m in self.members[start : start + n]))
            start += n
        return out

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs, start = [], 0
        for n in self.pieces:
            run = [m(x) for m in self.members[start : start + n]]
            outs.append(run[0] if n == 1 else torch.cat(run, dim=-1))
            start += n
        return tuple(outs)


class StackedWeights(nn.Module):
    """The weights of several modules stacked along dim 0 (the KDA conv kernels): here a concatenation per call; a serving
    layout keeps them stacked in one block instead (serve/prepare.py). Members held by reference, as in ProjectionGroup."""

    def __init__(self, members: Sequence[nn.Conv1d]) -> None:
        super().__init__()
        self.members = tuple(members)

    def weights(self) -> list[torch.Tensor]:
        return [m.weight for m in self.members]

    def forward(self) -> torch.Tensor:
        return torch.cat(self.weights(), dim=0)


class GatedMLP(nn.Module):
    """down(act(gate(x), up(x))): the dense first-layer MLP and the shared experts; the activation by the registry's "glu"."""

    def __init__(self, hidden: int, intermediate: int, act: Activation, situ_beta: float = 4.0, situ_linear_beta: float = 25.0) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.act = act
        self.situ_beta, self.situ_linear_beta = situ_beta, situ_linear_beta
        self.intermediate = intermediate
        self.gate_up = ProjectionGroup([self.gate_proj, self.up_proj])
        self.select(OpTarget(self.gate_proj.weight.device.type, dtype=self.gate_proj.weight.dtype))

    def select(self, target: OpTarget, impl: str = "auto") -> None:
        """The activation by the registry's "glu" (K3ForCausalLM.select_ops chooses again for what runs)."""
        self.glu = op("glu", impl, target)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(self.glu(gate, up, self.act, self.situ_beta, self.situ_linear_beta))
