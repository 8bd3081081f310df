"""Routed-expert ops: the naive definition, the grouped fast path, the sigmoid top-k router, and dispatch by name."""

from __future__ import annotations

from collections.abc import Callable

import torch

from openk3.ops.moe.bank import DenseExpertBank, ExpertBank, ExpertWeights
from openk3.ops.moe.grouped import moe_experts_grouped
from openk3.ops.moe.naive import Act, moe_experts_naive
from openk3.ops.moe.router import RouterOutput, sigmoid_topk_route

MOE_IMPLS = ("naive", "fast", "auto")

MoEExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ExpertBank, Act], torch.Tensor]


def moe_experts_op(impl: str) -> MoEExpertsFn:
    """The routed-expert function for an implementation name: "naive" (definition), "fast" or "auto" (grouped)."""
    if impl == "naive":
        return moe_experts_naive
    if impl in ("fast", "auto"):
        return moe_experts_grouped
    raise ValueError(f"moe experts impl={impl!r} is unknown, expected one of {', '.join(MOE_IMPLS)}")


__all__ = [
    "Act",
    "DenseExpertBank",
    "ExpertBank",
    "ExpertWeights",
    "MOE_IMPLS",
    "MoEExpertsFn",
    "RouterOutput",
    "moe_experts_grouped",
    "moe_experts_naive",
    "moe_experts_op",
    "sigmoid_topk_route",
]
