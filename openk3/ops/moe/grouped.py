"""Routed experts, grouped fast path: sort (token, slot) pairs by expert once, one matmul per active expert.

Legend: T tokens, k slots per token, P = T * k (token, slot) pairs, D expert input width, E experts.

A stable sort of the flattened expert ids makes each expert's pairs one contiguous slice; x rows are gathered in that order,
so each expert runs one dense matmul over its slice instead of a masked pass over all T tokens, and experts without tokens are
never asked for their weights (a packed MXFP4 bank then dequantises only what is used). Each slice's routing-weighted output is
added straight into the fp32 [T, D] result, so no [P, D] buffer is ever allocated (a fresh 2 MB buffer per call costs more in
page faults on CPU than the combine itself). The add is index_put_(accumulate=True), not index_add_: on CPU, torch's index_add_
enters a multi-threaded region even for one row, and on a machine whose cores are busy each call then waits out a scheduler
time slice (measured 75 ms for one row with 2 threads on the shared dev box, against 3 us for index_put_).
"""

from __future__ import annotations

import torch

from openk3.ops.linear import LinearFn, linear_torch
from openk3.ops.moe.bank import ExpertBank
from openk3.ops.moe.naive import Act, check_moe_inputs, expert_forward


def moe_experts_grouped(
    x_TD: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, bank: ExpertBank, act: Act, *, linear: LinearFn = linear_torch
) -> torch.Tensor:
    check_moe_inputs(x_TD, topk_idx, topk_weight, bank)
    k = topk_idx.shape[1]
    flat_P = topk_idx.reshape(-1)
    order_P = torch.sort(flat_P, stable=True).indices
    token_P = order_P // k
    # index_select rather than advanced indexing: the same gather, several times faster on CPU for row gathers.
    weight_P = topk_weight.reshape(-1).float().index_select(0, order_P)
    x_PD = x_TD.index_select(0, token_P)
    # One host sync for all slice bounds instead of one per expert.
    counts = torch.bincount(flat_P, minlength=bank.num_experts).tolist()
    y32 = torch.zeros(x_TD.shape, dtype=torch.float32, device=x_TD.device)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        out = expert_forward(x_PD[start:end], bank.expert(e, x_TD.dtype), act, e, linear)
        y32.index_put_((token_P[start:end],), out.float() * weight_P[start:end].unsqueeze(1), accumulate=True)
        start = end
    return y32.to(x_TD.dtype)
