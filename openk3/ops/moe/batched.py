"""Routed experts, batched small-step path: every active expert's rows in one padded [A, C, D] block, three bmm in all.

Legend: T tokens, k slots per token, P = T * k (token, slot) pairs, D expert input width, I expert intermediate width,
E experts, A experts with at least one pair (or E, see below), C the most pairs any expert got (the padded row count).

Why: at decode-sized steps (a few to a few hundred pairs) the grouped path's per-expert loop issues ~10 small ops per active
expert, and that launch overhead, not arithmetic, is the step time. Here the op count is fixed whatever the routing: pairs are
scattered into a zero-padded [A, C, D] block (the layout DeepEP's low-latency kernels use), each projection is one bmm over all
experts, and the outputs are gathered back and weight-summed per token. The cost is compute on padding rows, (A * C - P)
rows, which is why `moe_experts_sized` only picks this path for small steps.

Only experts with pairs are read: their weights are gathered into [A, I, D] unless at least half of the experts are active, in
which case the stacked bank is used in place (reading a few idle experts is cheaper than copying most of the bank).
Dense banks only: a packed MXFP4 bank goes through the grouped path, which dequantises one used expert at a time.
"""

from __future__ import annotations

import torch

from openk3.ops.linear import bmm_weight_t
from openk3.ops.moe.bank import DenseExpertBank, ExpertBank
from openk3.ops.moe.naive import Act, check_moe_inputs


def _expert_weights(bank: DenseExpertBank, active_A: torch.Tensor | None, dtype: torch.dtype) -> list[torch.Tensor]:
    """(w1, w3, w2) of the active experts in order ([A, I, D], [A, I, D], [A, D, I]), or the whole stacks when None."""
    stacks = [bank.w1_EID, bank.w3_EID, bank.w2_EDI]
    if active_A is not None:
        stacks = [w.index_select(0, active_A) for w in stacks]
    return [w.to(dtype) for w in stacks]


def moe_experts_batched(x_TD: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, bank: ExpertBank, act: Act) -> torch.Tensor:
    """A MoEExpertsFn like the others (chosen by name, so any bank may arrive): a DenseExpertBank is taken, any other bank
    raises TypeError."""
    check_moe_inputs(x_TD, topk_idx, topk_weight, bank)
    if not isinstance(bank, DenseExpertBank):
        raise TypeError(f"moe_experts_batched needs a DenseExpertBank (stacked weights), got {type(bank).__name__}")
    num_tokens, k = topk_idx.shape
    num_experts, dev = bank.num_experts, x_TD.device
    if num_tokens == 0:
        return torch.zeros_like(x_TD)
    flat_P = topk_idx.reshape(-1).long()
    counts_E = torch.bincount(flat_P, minlength=num_experts)
    order_P = torch.sort(flat_P, stable=True).indices
    expert_P = flat_P.index_select(0, order_P)
    # slot of each pair inside its expert's block: its rank among that expert's pairs (pairs are sorted by expert)
    first_E = torch.cumsum(counts_E, 0) - counts_E
    slot_P = torch.arange(flat_P.numel(), device=dev) - first_E.index_select(0, expert_P)
    active_E = counts_E > 0
    num_active, rows = int(active_E.sum()), int(counts_E.max())
    if 2 * num_active >= num_experts:
        block_P, active_A = expert_P, None
    else:  # compact: block b holds the b-th active expert
        block_P = (torch.cumsum(active_E, 0) - 1).index_select(0, expert_P)
        active_A = active_E.nonzero().squeeze(1)
    w1, w3, w2 = _expert_weights(bank, active_A, x_TD.dtype)
    token_P = order_P // k
    x_ACD = x_TD.new_zeros((w1.shape[0], rows, x_TD.shape[1]))
    x_ACD[block_P, slot_P] = x_TD.index_select(0, token_P)
    h_ACI = act(bmm_weight_t(x_ACD, w1), bmm_weight_t(x_ACD, w3))
    out_ACD = bmm_weight_t(h_ACI, w2)
    weight_P = topk_weight.reshape(-1).float().index_select(0, order_P)
    y_PD = out_ACD[block_P, slot_P].float() * weight_P.unsqueeze(1)
    y32 = torch.zeros(x_TD.shape, dtype=torch.float32, device=dev)
    y32.index_put_((token_P,), y_PD, accumulate=True)
    return y32.to(x_TD.dtype)
