"""Sigmoid top-k router with a selection-only bias (DeepSeek-V3 / Kimi style).

Legend: T tokens, D router input width (the full hidden width), E experts, k experts per token.

The bias (`e_score_correction_bias`) steers which experts are chosen, so load balancing can move it without touching the
gradient path; the combine weights come from the unbiased scores so the bias never scales an expert's output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from openk3.ops.moe.cpu_pairs import MAX_K, route_c


class RouterOutput(NamedTuple):
    topk_idx: torch.Tensor  # [T, k] int64
    topk_weight: torch.Tensor  # [T, k] fp32
    scores: torch.Tensor  # [T, E] fp32 sigmoid scores (unbiased; training-time balancing reads them)


def _logits(x_TD: torch.Tensor, weight_ED: torch.Tensor, bias_E: torch.Tensor | None, k: int) -> torch.Tensor:
    if x_TD.dim() != 2 or weight_ED.dim() != 2 or x_TD.shape[1] != weight_ED.shape[1]:
        raise ValueError(f"router: x shape {tuple(x_TD.shape)} and weight shape {tuple(weight_ED.shape)}, expected [T, D] and [E, D]")
    num_experts = weight_ED.shape[0]
    if bias_E is not None and bias_E.shape != (num_experts,):
        raise ValueError(f"router: bias shape {tuple(bias_E.shape)}, expected ({num_experts},)")
    if not 1 <= k <= num_experts:
        raise ValueError(f"router: k={k}, expected 1..{num_experts} (the number of experts)")
    return x_TD.float() @ weight_ED.float().t()


def sigmoid_topk_route(x_TD: torch.Tensor, weight_ED: torch.Tensor, bias_E: torch.Tensor | None, k: int, renormalize: bool, scaling: float) -> RouterOutput:
    """The router in torch ops (the registry's "moe_route" "naive", on every backend)."""
    scores_TE = torch.sigmoid(_logits(x_TD, weight_ED, bias_E, k))
    selection_TE = scores_TE if bias_E is None else scores_TE + bias_E.float()
    topk_idx = torch.topk(selection_TE, k, dim=-1).indices
    weight_Tk = scores_TE.gather(1, topk_idx)
    if renormalize:
        # 1e-20 only guards an all-zero row (every selected score underflowed); it is below any real sigmoid sum.
        weight_Tk = weight_Tk / (weight_Tk.sum(-1, keepdim=True) + 1e-20)
    return RouterOutput(topk_idx, weight_Tk * scaling, scores_TE)


def sigmoid_topk_route_c(x_TD: torch.Tensor, weight_ED: torch.Tensor, bias_E: torch.Tensor | None, k: int, renormalize: bool, scaling: float) -> RouterOutput:
    """The same steps after the logits in one C loop ("fast" on the "c" backend: ops/moe/cpu_pairs.py); a top-k wider
    than the loop's stack buffer (MAX_K) runs in torch."""
    if k > MAX_K:
        return sigmoid_topk_route(x_TD, weight_ED, bias_E, k, renormalize, scaling)
    return RouterOutput(*route_c(_logits(x_TD, weight_ED, bias_E, k), bias_E.float() if bias_E is not None else None, k, renormalize, scaling))


RouterFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, int, bool, float], RouterOutput]
