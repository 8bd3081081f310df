"""Routed-expert ops: the naive definition, the grouped, batched and single-token fast paths, the sigmoid top-k router, and
dispatch by name."""

from __future__ import annotations

from collections.abc import Callable

import torch

from openk3.ops.moe.bank import DenseExpertBank, ExpertBank, ExpertWeights
from openk3.ops.moe.batched import moe_experts_batched
from openk3.ops.moe.cpu_pairs import expert_loop_in_c
from openk3.ops.moe.grouped import moe_experts_grouped
from openk3.ops.moe.naive import Act, moe_experts_naive
from openk3.ops.moe.router import RouterOutput, sigmoid_topk_route
from openk3.ops.moe.single import moe_experts_single_token

MOE_IMPLS = ("naive", "fast", "batched", "auto")

MoEExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ExpertBank, Act], torch.Tensor]

# The batched path pays for padding rows and a fixed ~25 ops; the grouped loop pays ~10 ops per active expert. Measured with
# benchmarks/ops_moe.py (CPU, 2 threads, E 16, k 2 and 4; benchmarks/results/ops_moe.md): from 16 (token, expert) pairs up
# to 16 pairs per expert batched is 1.0-1.9x the grouped loop; at 32 pairs per expert it is 0.5x (padding then costs more
# than the loop's dispatch), and below 16 pairs the loop's few iterations are cheaper than the batched set-up.
BATCHED_MIN_PAIRS = 16
BATCHED_MAX_PAIRS_PER_EXPERT = 16
# With the expert MLPs in C (ops/moe/cpu_pairs.py: no padding rows, one call for all experts) the batched path is 7-9x
# the grouped loop up to 16 tokens, ~3.5x the single-token path at one token, 1.4-3.4x from 4 to 64 pairs per expert,
# and 0.7x at 128-256 pairs per expert, where the loop's large per-expert GEMMs win (same table).
C_LOOP_MAX_PAIRS_PER_EXPERT = 64


def moe_experts_auto(x_TD: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, bank: ExpertBank, act: Act) -> torch.Tensor:
    """Dense banks whose expert MLPs run in C: batched up to C_LOOP_MAX_PAIRS_PER_EXPERT; otherwise one token: its experts in
    turn; dense banks at decode-sized steps: batched; the rest (and packed MXFP4 banks): grouped."""
    pairs = topk_idx.numel()
    if isinstance(bank, DenseExpertBank) and 1 <= pairs <= C_LOOP_MAX_PAIRS_PER_EXPERT * bank.num_experts and expert_loop_in_c(x_TD, bank, act):
        return moe_experts_batched(x_TD, topk_idx, topk_weight, bank, act)
    if topk_idx.shape[0] == 1:
        return moe_experts_single_token(x_TD, topk_idx, topk_weight, bank, act)
    if isinstance(bank, DenseExpertBank) and BATCHED_MIN_PAIRS <= pairs <= BATCHED_MAX_PAIRS_PER_EXPERT * bank.num_experts:
        return moe_experts_batched(x_TD, topk_idx, topk_weight, bank, act)
    return moe_experts_grouped(x_TD, topk_idx, topk_weight, bank, act)


def moe_experts_op(impl: str) -> MoEExpertsFn:
    """The routed-expert function for an implementation name: "naive" (definition), "fast" (grouped), "batched" (dense banks
    only) or "auto" (picks per call among single-token, batched and grouped)."""
    ops: dict[str, MoEExpertsFn] = {
        "naive": moe_experts_naive,
        "fast": moe_experts_grouped,
        "batched": moe_experts_batched,  # dense banks only; raises TypeError on others
        "auto": moe_experts_auto,
    }
    if impl not in ops:
        raise ValueError(f"moe experts impl={impl!r} is unknown, expected one of {', '.join(MOE_IMPLS)}")
    return ops[impl]


__all__ = [
    "Act",
    "DenseExpertBank",
    "ExpertBank",
    "ExpertWeights",
    "MOE_IMPLS",
    "MoEExpertsFn",
    "RouterOutput",
    "moe_experts_auto",
    "moe_experts_batched",
    "moe_experts_grouped",
    "moe_experts_naive",
    "moe_experts_single_token",
    "moe_experts_op",
    "sigmoid_topk_route",
]
