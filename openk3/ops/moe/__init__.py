"""Routed-expert ops: the naive definition, the grouped, batched and single-token fast paths, the fixed-shape form, the
sigmoid top-k router, and the size-chosen dispatch among them (the registry's "sized"; names in ops/registry.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from openk3.ops.linear import LinearFn, linear_torch
from openk3.ops.moe.bank import DenseExpertBank, ExpertBank, ExpertWeights
from openk3.ops.moe.batched import moe_experts_batched
from openk3.ops.moe.cpu_pairs import act_in_c, c_loop_fits
from openk3.ops.moe.grouped import moe_experts_grouped
from openk3.ops.moe.naive import Act, moe_experts_naive
from openk3.ops.moe.packed_bank import PackedMXFP4ExpertBank
from openk3.ops.moe.packed_c import packed_c_fits
from openk3.ops.moe.router import RouterOutput, sigmoid_topk_route
from openk3.ops.moe.single import moe_experts_single_token
from openk3.ops.moe.static import moe_experts_static
from openk3.ops.thresholds import BATCHED_MAX_PAIRS_PER_EXPERT, BATCHED_MIN_PAIRS, C_LOOP_MAX_PAIRS_PER_EXPERT, PACKED_DECODE_MAX_BYTES

MoEExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ExpertBank, Act], torch.Tensor]


def moe_experts_sized(
    x_TD: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    bank: ExpertBank,
    act: Act,
    *,
    linear: LinearFn = linear_torch,
    batched_c: MoEExpertsFn | None = None,
    packed_c: MoEExpertsFn | None = None,
) -> torch.Tensor:
    """The form by the step's size (the registry's "sized"; switches in ops/thresholds.py). With `batched_c` (the "c"
    backend: ops/moe/cpu_pairs.py) dense banks whose expert MLPs run in C go batched up to C_LOOP_MAX_PAIRS_PER_EXPERT.
    Packed MXFP4 banks, with `packed_c` (the "c" backend: ops/moe/packed_c.py): every picked expert's MLP in one C call that
    decodes the weights in registers, up to C_LOOP_MAX_PAIRS_PER_EXPERT pairs per expert. Without it, in a step of several
    tokens: the experts the step picked decoded at once into a dense bank of their own and run through `batched_c`, when
    they fit PACKED_DECODE_MAX_BYTES (tokens that share an expert share its decoding). Otherwise one token: its experts in
    turn; dense banks at decode-sized steps: batched; the rest: grouped. `linear`: the products of the per-expert forms."""
    pairs = topk_idx.numel()
    if packed_c is not None and 1 <= pairs <= C_LOOP_MAX_PAIRS_PER_EXPERT * bank.num_experts and packed_c_fits(x_TD, bank, act):
        return packed_c(x_TD, topk_idx, topk_weight, bank, act)
    if batched_c is not None and isinstance(bank, PackedMXFP4ExpertBank) and pairs > topk_idx.shape[1] and act_in_c(x_TD, act):
        picked = torch.unique(topk_idx)  # sorted
        n = picked.numel()
        decoded_bytes = n * 3 * bank.intermediate_size * bank.width * x_TD.element_size()
        if decoded_bytes <= PACKED_DECODE_MAX_BYTES and pairs <= C_LOOP_MAX_PAIRS_PER_EXPERT * n:
            remap = torch.empty(bank.num_experts, dtype=torch.long, device=topk_idx.device)
            remap[picked] = torch.arange(n, device=topk_idx.device)
            return batched_c(x_TD, remap[topk_idx], topk_weight, bank.decoded(picked, x_TD.dtype), act)
    if (
        batched_c is not None
        and isinstance(bank, DenseExpertBank)
        and 1 <= pairs <= C_LOOP_MAX_PAIRS_PER_EXPERT * bank.num_experts
        and c_loop_fits(x_TD, bank, act)
    ):
        return batched_c(x_TD, topk_idx, topk_weight, bank, act)
    if topk_idx.shape[0] == 1:
        return moe_experts_single_token(x_TD, topk_idx, topk_weight, bank, act, linear=linear)
    if isinstance(bank, DenseExpertBank) and BATCHED_MIN_PAIRS <= pairs <= BATCHED_MAX_PAIRS_PER_EXPERT * bank.num_experts:
        return (batched_c or moe_experts_batched)(x_TD, topk_idx, topk_weight, bank, act)
    return moe_experts_grouped(x_TD, topk_idx, topk_weight, bank, act, linear=linear)


__all__ = [
    "Act",
    "DenseExpertBank",
    "ExpertBank",
    "ExpertWeights",
    "MoEExpertsFn",
    "RouterOutput",
    "moe_experts_sized",
    "moe_experts_batched",
    "moe_experts_grouped",
    "moe_experts_naive",
    "moe_experts_single_token",
    "moe_experts_static",
    "sigmoid_topk_route",
]
