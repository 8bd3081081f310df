"""Routed experts for a single token (decode at batch 1): its k experts one after another, no sorting or scatter.

Legend: D expert input width, k experts per token.

Why: with one token, the grouped path's bookkeeping (sort, bincount, gathers, an fp32 scatter-add per expert) is most of its
~45 ops while the k expert matmuls are the only real work; here the ids come to the host once and each expert's output is
weighted and summed directly (~12 ops per expert). The bank is asked only for the token's experts, as in the grouped path, so
packed MXFP4 banks dequantise just those. Summation in fp32, one rounding at the end, as in every other MoE op.
"""

from __future__ import annotations

import torch

from openk3.ops.linear import LinearFn, linear_torch
from openk3.ops.moe.bank import ExpertBank
from openk3.ops.moe.naive import Act, check_moe_inputs, expert_forward


def moe_experts_single_token(
    x_1D: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, bank: ExpertBank, act: Act, *, linear: LinearFn = linear_torch
) -> torch.Tensor:
    if x_1D.dim() != 2 or x_1D.shape[0] != 1:
        raise ValueError(f"moe_experts_single_token: x shape {tuple(x_1D.shape)}, expected [1, D] (one token)")
    check_moe_inputs(x_1D, topk_idx, topk_weight, bank, check_ids=False)
    ids = topk_idx[0].tolist()
    if any(not 0 <= e < bank.num_experts for e in ids):
        raise ValueError(f"moe experts: expert ids {ids}, expected 0..{bank.num_experts - 1}")
    weights = topk_weight[0].float().tolist()  # on the host with the ids: each expert's weight folds into its add
    y32 = torch.zeros(x_1D.shape, dtype=torch.float32, device=x_1D.device)
    for e, w in zip(ids, weights, strict=True):
        y32.add_(expert_forward(x_1D, bank.expert(e, x_1D.dtype), act, e, linear).float(), alpha=w)
    return y32.to(x_1D.dtype)
