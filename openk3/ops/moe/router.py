"""Sigmoid top-k router with a selection-only bias (DeepSeek-V3 / Kimi style).

Legend: T tokens, D router input width (the full hidden width), E experts, k experts per token.

The bias (`e_score_correction_bias`) steers which experts are chosen, so load balancing can move it without touching the
gradient path; the combine weights come from the unbiased scores so the bias never scales an expert's output.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from openk3.ops.moe.cpu_pairs import route_cpu


class RouterOutput(NamedTuple):
    topk_idx: torch.Tensor  # [T, k] int64
    topk_weight: torch.Tensor  # [T, k] fp32
    scores: torch.Tensor  # [T, E] fp32 sigmoid scores (unbiased; training-time balancing reads them)


def sigmoid_topk_route(x_TD: torch.Tensor, weight_ED: torch.Tensor, bias_E: torch.Tensor | None, k: int, renormalize: bool, scaling: float) -> RouterOutput:
    if x_TD.dim() != 2 or weight_ED.dim() != 2 or x_TD.shape[1] != weight_ED.shape[1]:
        raise ValueError(f"router: x shape {tuple(x_TD.shape)} and weight shape {tuple(weight_ED.shape)}, expected [T, D] and [E, D]")
    num_experts = weight_ED.shape[0]
    if bias_E is not None and bias_E.shape != (num_experts,):
        raise ValueError(f"router: bias shape {tuple(bias_E.shape)}, expected ({num_experts},)")
    if not 1 <= k <= num_experts:
        raise ValueError(f"router: k={k}, expected 1..{num_experts} (the number of experts)")
    logits_TE = x_TD.float() @ weight_ED.float().t()
    fast = route_cpu(logits_TE, bias_E.float() if bias_E is not None else None, k, renormalize, scaling)
    if fast is not None:  # the same steps as below in one C loop (CPU inference)
        return RouterOutput(*fast)
    scores_TE = torch.sigmoid(logits_TE)
    selection_TE = scores_TE if bias_E is None else scores_TE + bias_E.float()
    topk_idx = torch.topk(selection_TE, k, dim=-1).indices
    weight_Tk = scores_TE.gather(1, topk_idx)
    if renormalize:
        # 1e-20 only guards an all-zero row (every selected score underflowed); it is below any real sigmoid sum.
        weight_Tk = weight_Tk / (weight_Tk.sum(-1, keepdim=True) + 1e-20)
    return RouterOutput(topk_idx, weight_Tk * scaling, scores_TE)
