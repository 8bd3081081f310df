"""Routed experts, grouped fast path: sort (token, slot) pairs by expert once, one matmul per active expert.

Legend: T tokens, k slots per token, P = T * k (token, slot) pairs, D expert input width, E experts.

A stable sort of the flattened expert ids makes each expert's pairs one contiguous slice; x rows are gathered in that order,
so each expert runs one dense matmul over its slice instead of a masked pass over all T tokens, and experts without tokens are
never asked for their weights (a packed MXFP4 bank then dequantises only what is used). The routing-weighted outputs are
index_add'ed back per token in fp32, matching the naive definition.
"""

from __future__ import annotations

import torch

from openk3.ops.moe.bank import ExpertBank
from openk3.ops.moe.naive import Act, check_moe_inputs, expert_forward


def moe_experts_grouped(x_TD: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, bank: ExpertBank, act: Act) -> torch.Tensor:
    check_moe_inputs(x_TD, topk_idx, topk_weight, bank)
    k = topk_idx.shape[1]
    flat_P = topk_idx.reshape(-1)
    order_P = torch.sort(flat_P, stable=True).indices
    token_P = order_P // k
    weight_P = topk_weight.reshape(-1).float()[order_P]
    x_PD = x_TD[token_P]
    # One host sync for all slice bounds instead of one per expert.
    counts = torch.bincount(flat_P, minlength=bank.num_experts).tolist()
    y32 = torch.zeros(x_TD.shape, dtype=torch.float32, device=x_TD.device)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        out = expert_forward(x_PD[start:end], bank.expert(e, x_TD.dtype), act, e)
        y32.index_add_(0, token_P[start:end], weight_P[start:end].unsqueeze(1) * out.float())
        start = end
    return y32.to(x_TD.dtype)
