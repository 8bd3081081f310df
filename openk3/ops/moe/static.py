"""Routed experts with fixed shapes: every expert over every token of the step, weighted by the routing (zero where the
token did not choose the expert). No host read and no data-dependent size, so a step using it can be captured in a graph.

Legend: T tokens, k experts per token, E experts, D expert input width, I expert intermediate width.

Why: the other forms size their work by the routing (per-expert pair counts read back to the host, or a padded block
sized by the busiest expert), which a captured graph cannot do. The price is E * T expert rows instead of k * T and the
whole bank read per layer: at K3's E / k = 896 / 16 that is 56x the routed arithmetic, and at T = 16 about 4x the expert
weights a routed form reads (16 x 16 pairs touch about 223 of the 896 experts). So it is the graph form for small expert
counts and dense banks; packed MXFP4 experts on CUDA take the Triton grouped GEMM (moe_experts "triton"), which reads
them packed through a launch table built on the device (serve/graphs.py graph_expert_form).
The result equals the routed sum up to the order of fp32 additions (the unchosen experts add exact zeros).
"""

from __future__ import annotations

import torch

from openk3.ops.linear import bmm_weight_t
from openk3.ops.moe.bank import DenseExpertBank, ExpertBank
from openk3.ops.moe.naive import Act, check_moe_inputs, expert_forward


def routing_weights(topk_idx: torch.Tensor, topk_weight: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, E] fp32: each token's weight for each expert, 0 for the experts it did not choose (a token names an expert once)."""
    out = torch.zeros(topk_idx.shape[0], num_experts, dtype=torch.float32, device=topk_weight.device)
    return out.scatter_(1, topk_idx.long(), topk_weight.float())


def moe_experts_static(x_TD: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, bank: ExpertBank, act: Act) -> torch.Tensor:
    # check_ids=False: the id range check reads the ids back; scatter_ raises on an id out of range on CPU, and the
    # router's top-k cannot produce one
    check_moe_inputs(x_TD, topk_idx, topk_weight, bank, check_ids=False)
    num_tokens, width = x_TD.shape
    weight_TE = routing_weights(topk_idx, topk_weight, bank.num_experts)
    if isinstance(bank, DenseExpertBank):  # all experts in three bmm
        x_ETD = x_TD.unsqueeze(0).expand(bank.num_experts, num_tokens, width)
        w1, w3, w2 = (w.to(x_TD.dtype) for w in (bank.w1_EID, bank.w3_EID, bank.w2_EDI))
        y_ETD = bmm_weight_t(act(bmm_weight_t(x_ETD, w1), bmm_weight_t(x_ETD, w3)), w2)
        return torch.einsum("etd,te->td", y_ETD.float(), weight_TE).to(x_TD.dtype)
    y32 = torch.zeros((num_tokens, width), dtype=torch.float32, device=x_TD.device)
    for e in range(bank.num_experts):
        y32.addcmul_(expert_forward(x_TD, bank.expert(e, x_TD.dtype), act, e).float(), weight_TE[:, e : e + 1])
    return y32.to(x_TD.dtype)
