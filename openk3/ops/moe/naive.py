"""Routed experts, the definition: loop over every expert with a token mask.

Legend: T tokens, D expert input width, I expert intermediate width, E experts, k experts per token.

y[t] = sum_j w[t, j] * W2_e act(W1_e x_t, W3_e x_t) with e = topk_idx[t, j]. Expert matmuls run in x's dtype (as served);
the weighted sum accumulates in fp32 and is cast back once, so a bf16 result is rounded once, not once per expert.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from openk3.ops.linear import LinearFn, linear_torch
from openk3.ops.moe.bank import ExpertBank, ExpertWeights

Act = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_moe_inputs(x_TD: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, bank: ExpertBank, check_ids: bool = True) -> None:
    """Shapes and dtypes; with check_ids also the id range (two host syncs; a caller that reads the ids anyway checks them)."""
    if x_TD.dim() != 2:
        raise ValueError(f"moe experts: x shape {tuple(x_TD.shape)}, expected [T, D]")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x_TD.shape[0]:
        raise ValueError(f"moe experts: topk_idx shape {tuple(topk_idx.shape)}, expected [{x_TD.shape[0]}, k] (one row per token)")
    if topk_weight.shape != topk_idx.shape:
        raise ValueError(f"moe experts: topk_weight shape {tuple(topk_weight.shape)}, expected {tuple(topk_idx.shape)} like topk_idx")
    if topk_idx.dtype.is_floating_point or topk_idx.dtype == torch.bool:
        raise ValueError(f"moe experts: topk_idx dtype {topk_idx.dtype}, expected an integer dtype")
    if check_ids and topk_idx.numel() and (int(topk_idx.min()) < 0 or int(topk_idx.max()) >= bank.num_experts):
        raise ValueError(f"moe experts: expert ids span {int(topk_idx.min())}..{int(topk_idx.max())}, expected 0..{bank.num_experts - 1}")


def expert_forward(x_ND: torch.Tensor, weights: ExpertWeights, act: Act, e: int, linear: LinearFn = linear_torch) -> torch.Tensor:
    """W2 act(W1 x, W3 x) for one expert's rows, the products by `linear` (an entry of the registry's "linear"); checks the
    bank's shapes against x so a wrong bank names the expert."""
    w1, w3, w2 = weights
    width = x_ND.shape[1]
    if w1.dim() != 2 or w1.shape[1] != width or w3.shape != w1.shape or w2.shape != (width, w1.shape[0]):
        raise ValueError(
            f"moe experts: expert {e} weights w1 {tuple(w1.shape)}, w3 {tuple(w3.shape)}, w2 {tuple(w2.shape)}, "
            f"expected [I, {width}], [I, {width}], [{width}, I] for input width {width}"
        )
    return linear(act(linear(x_ND, w1), linear(x_ND, w3)), w2)


def moe_experts_naive(x_TD: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, bank: ExpertBank, act: Act) -> torch.Tensor:
    check_moe_inputs(x_TD, topk_idx, topk_weight, bank)
    y32 = torch.zeros(x_TD.shape, dtype=torch.float32, device=x_TD.device)
    for e in range(bank.num_experts):
        hit_Tk = topk_idx == e
        tokens = hit_Tk.any(dim=1).nonzero().squeeze(1)
        if tokens.numel() == 0:
            continue
        # Summing the masked weights also covers a token that lists the same expert twice (not produced by top-k, but well defined).
        w_N = (topk_weight.float() * hit_Tk).sum(dim=1)[tokens]
        out = expert_forward(x_TD[tokens], bank.expert(e, x_TD.dtype), act, e)
        y32[tokens] += w_N.unsqueeze(1) * out.float()
    return y32.to(x_TD.dtype)
