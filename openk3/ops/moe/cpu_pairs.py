"""The router's top-k, the batched expert path's pair bookkeeping and its expert MLPs as C loops on CPU (ops/cpu/moe.c).

Legend: T tokens, E experts, k experts per token, P = T * k (token, expert) pairs, D expert input width, C rows per expert.

Why: at decode sizes the router's sigmoid / bias / top-k / gather / renormalise and the batched path's sort / bincount /
cumsum / scatter / gather / scatter-add are ~35 torch ops per MoE layer that move a few hundred values each; their dispatch
is most of the layer's time outside the expert matmuls. The expert MLPs themselves -- three batched products over the padded
block plus the activation -- become one C loop over experts that multiplies only each expert's real rows, straight from the
stored weights (ops/cpu/rows_gemm.h); torch's batched product packs every expert's weight first and computes the padding
rows too. These are the "c" backend's entries of "moe_route" and "moe_experts" (ops/registry.py); the torch ops remain
the reference (tests/ops/test_moe.py compares the two). They refuse what they were not chosen for (autograd on, not CPU
fp32: ops/cpu/__init__.py); a top-k wider than MAX_K, or a step where too few experts are active for the padded batched
products to pay, is a size the C loops leave to the torch form.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

import torch

from openk3.config import Activation
from openk3.ops.activation import glu
from openk3.ops.cpu import require_inference
from openk3.ops.cpu.build import kernel, load
from openk3.ops.linear import bmm_weight_t
from openk3.ops.moe.bank import DenseExpertBank, ExpertBank
from openk3.ops.moe.batched import moe_experts_batched
from openk3.ops.moe.naive import Act, check_moe_inputs

MAX_K = 64  # the C top-k keeps its candidates on the stack
_ACT_CODES = {Activation.SILU: 0, Activation.SITU: 1}  # moe.c's ACT_SILU, ACT_SITU


@functools.cache
def _lib() -> Any:
    """ops/cpu/moe.c, loaded once per process, its functions typed (the "c" backend's entries only)."""
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    signatures = {
        "openk3_moe_route": ([i64, i64, i64, ptr, ptr, ctypes.c_int, f32, ptr, ptr], None),
        "openk3_moe_plan": ([i64, i64, ptr, ptr, ptr], i64),
        "openk3_moe_gather": ([i64, i64, i64, i64, ptr, ptr, ptr, i64, ptr], None),
        "openk3_moe_combine": ([i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr], None),
        "openk3_moe_experts_glu": ([i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_int, f32, f32, ptr, ctypes.c_int], ctypes.c_int),
    }
    for name, (argtypes, restype) in signatures.items():
        kernel("moe.c", name, argtypes, restype)
    return load("moe.c")  # the library object now holds the typed functions


def route_c(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, k: int, renormalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(topk_idx [T, k] int64, topk_weight [T, k] fp32, scores [T, E] fp32) from fp32 router logits, as sigmoid_topk_route
    computes them (1 <= k <= MAX_K). The logits tensor becomes the scores (it is the caller's temporary). Ties in the
    biased score go to the lower expert id (torch.topk leaves their order unspecified)."""
    require_inference("moe router", logits_TE, *([bias_E] if bias_E is not None else []))
    if not 1 <= k <= min(MAX_K, logits_TE.shape[1]):
        raise ValueError(f"moe router: k={k}, the C loop takes 1..{min(MAX_K, logits_TE.shape[1])}")
    logits_TE = logits_TE.contiguous()
    bias = bias_E.contiguous() if bias_E is not None else None
    num_tokens, num_experts = logits_TE.shape
    idx = torch.empty(num_tokens, k, dtype=torch.int64)
    weight = torch.empty(num_tokens, k, dtype=torch.float32)
    bias_ptr = bias.data_ptr() if bias is not None else None
    _lib().openk3_moe_route(num_tokens, num_experts, k, logits_TE.data_ptr(), bias_ptr, int(renormalize), scaling, idx.data_ptr(), weight.data_ptr())
    return idx, weight, logits_TE


@dataclass(frozen=True)
class PairPlan:
    """openk3_moe_plan's bookkeeping of a step's (token, expert) pairs: the ids and weights as the C calls read them, the
    rows per expert, each pair's row slot, and the padded rows per expert (the largest count)."""

    idx: torch.Tensor  # [T, k] int64
    weight: torch.Tensor  # [T, k] fp32
    counts: torch.Tensor  # [E] int64
    slot_P: torch.Tensor  # [T * k] int64
    rows: int


def plan_pairs(topk_idx: torch.Tensor, topk_weight: torch.Tensor, num_experts: int) -> PairPlan:
    """The pairs planned in C; a ValueError naming the span when an id is outside 0..num_experts - 1."""
    idx = topk_idx.to(torch.int64).contiguous()
    weight = topk_weight.to(torch.float32).contiguous()
    counts, slot_P = torch.empty(num_experts, dtype=torch.int64), torch.empty(idx.numel(), dtype=torch.int64)
    rows = _lib().openk3_moe_plan(idx.numel(), num_experts, idx.data_ptr(), counts.data_ptr(), slot_P.data_ptr())
    if rows < 0:
        raise ValueError(f"moe experts: expert ids span {int(idx.min())}..{int(idx.max())}, expected 0..{num_experts - 1}")
    return PairPlan(idx, weight, counts, slot_P, rows)


def combine_pairs(plan: PairPlan, out_ECD: torch.Tensor, width: int) -> torch.Tensor:
    """[T, D] fp32: each token's expert outputs (rows of out_ECD, by the plan's slots) summed with their weights, in C."""
    num_tokens, k = plan.idx.shape
    y = torch.empty(num_tokens, width, dtype=torch.float32)
    idx, slots = plan.idx, plan.slot_P
    _lib().openk3_moe_combine(num_tokens, k, width, plan.rows, idx.data_ptr(), slots.data_ptr(), plan.weight.data_ptr(), out_ECD.data_ptr(), y.data_ptr())
    return y


def _glu_in_c(act: Act) -> tuple[int, float, float] | None:
    """(moe.c's activation code, beta, linear_beta) when `act` is ops/activation.glu with its settings given by keyword -- how
    the model builds `expert_act` -- else None (any other callable runs in torch between the batched products)."""
    if not isinstance(act, functools.partial) or act.func is not glu or act.args:
        return None
    kw = act.keywords
    kind = kw.get("kind")
    code = None if kind is None else _ACT_CODES.get(kind)
    if code is None or not set(kw) <= {"kind", "beta", "linear_beta"}:
        return None
    return code, float(kw.get("beta", 4.0)), float(kw.get("linear_beta", 25.0))


def act_in_c(x_TD: torch.Tensor, act: Act) -> bool:
    """moe.c's expert loop takes these rows and this activation (c_loop_fits less the bank's layout)."""
    return x_TD.dim() == 2 and _glu_in_c(act) is not None


def c_loop_fits(x_TD: torch.Tensor, bank: DenseExpertBank, act: Act) -> bool:
    """The batched path's expert MLPs run as moe.c's expert loop for these inputs: an activation it knows, contiguous
    stacked weights. moe_experts_sized then widens the batched path's window (the loop computes no padding rows and reads
    no idle expert's weights)."""
    weights = (bank.w1_EID, bank.w3_EID, bank.w2_EDI)
    return x_TD.dim() == 2 and all(w.is_contiguous() for w in weights) and _glu_in_c(act) is not None


def moe_experts_batched_c(x_TD: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, bank: ExpertBank, act: Act) -> torch.Tensor:
    """moe_experts_batched's result with the whole stacked bank and the pair bookkeeping in C. The expert MLPs run in C
    too when `c_loop_fits`; otherwise they are three batched products over the padded block, and when fewer than half of the
    experts are active the torch form runs (it reads only those)."""
    check_moe_inputs(x_TD, topk_idx, topk_weight, bank, check_ids=False)  # openk3_moe_plan checks the ids
    if not isinstance(bank, DenseExpertBank):
        raise TypeError(f"moe_experts_batched needs a DenseExpertBank (stacked weights), got {type(bank).__name__}")
    weights = tuple(w.contiguous() for w in (bank.w1_EID, bank.w3_EID, bank.w2_EDI))
    require_inference("moe experts", x_TD, *weights)
    num_tokens, k = topk_idx.shape
    num_experts, width = bank.num_experts, x_TD.shape[1]
    if weights[0].shape[2] != width:
        raise ValueError(f"moe experts: w1 {tuple(weights[0].shape)}, expected [E, I, {width}] for input width {width}")
    if num_tokens == 0:
        return torch.zeros_like(x_TD)
    x_TD = x_TD if x_TD.stride(-1) == 1 else x_TD.contiguous()
    lib = _lib()
    plan = plan_pairs(topk_idx, topk_weight, num_experts)
    idx, slot_P, counts, rows = plan.idx, plan.slot_P, plan.counts, plan.rows
    glu_c = _glu_in_c(act)
    if glu_c is None and 2 * int((counts > 0).sum()) < num_experts:
        return moe_experts_batched(x_TD, topk_idx, topk_weight, bank, act)
    # the C expert loop reads only each expert's first counts[e] rows; the batched products read the padding as well
    x_ECD = x_TD.new_empty(num_experts, rows, width) if glu_c is not None else x_TD.new_zeros(num_experts, rows, width)
    lib.openk3_moe_gather(idx.numel(), k, width, rows, idx.data_ptr(), slot_P.data_ptr(), x_TD.data_ptr(), x_TD.stride(0), x_ECD.data_ptr())
    if glu_c is not None:
        out_ECD = torch.empty_like(x_ECD)  # the loop writes each expert's first counts[e] rows, the only ones combine reads
        code, beta, linear_beta = glu_c
        w1, w3, w2 = weights
        failed = lib.openk3_moe_experts_glu(
            num_experts, rows, width, w1.shape[1], counts.data_ptr(), x_ECD.data_ptr(), w1.data_ptr(), w3.data_ptr(), w2.data_ptr(),
            code, beta, linear_beta, out_ECD.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError("moe experts: the C expert loop could not allocate its scratch rows")
    else:
        out_ECD = bmm_weight_t(act(bmm_weight_t(x_ECD, weights[0]), bmm_weight_t(x_ECD, weights[1])), weights[2]).contiguous()
    return combine_pairs(plan, out_ECD, width)
