"""The router's top-k and the batched expert path's pair bookkeeping as C loops on CPU (ops/cpu/moe.c).

Legend: T tokens, E experts, k experts per token, P = T * k (token, expert) pairs, D expert input width, C rows per expert.

Why: at decode sizes the router's sigmoid / bias / top-k / gather / renormalise and the batched path's sort / bincount /
cumsum / scatter / gather / scatter-add are ~35 torch ops per MoE layer that move a few hundred values each; their dispatch
is most of the layer's time outside the expert matmuls. Each function here returns None when the C library is unavailable
or the call is outside what it handles (not CPU fp32, autograd on), and its caller runs the torch ops, which remain the
reference (tests/ops/test_moe.py compares the two).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from openk3.ops.cpu import cpu_fp32, records_grad
from openk3.ops.cpu.build import bind, load
from openk3.ops.linear import bmm_weight_t
from openk3.ops.moe.bank import DenseExpertBank
from openk3.ops.moe.naive import Act

MAX_K = 64  # the C top-k keeps its candidates on the stack


def _inference_cpu_fp32(*tensors: torch.Tensor) -> bool:
    return cpu_fp32(*tensors) and not records_grad(*tensors)


@functools.cache
def _lib() -> Any:
    """ops/cpu/moe.c, loaded once per process; None when it cannot be built or is switched off."""
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    signatures = {
        "openk3_moe_route": ([i64, i64, i64, ptr, ptr, ctypes.c_int, f32, ptr, ptr], None),
        "openk3_moe_plan": ([i64, i64, ptr, ptr, ptr], i64),
        "openk3_moe_gather": ([i64, i64, i64, i64, ptr, ptr, ptr, i64, ptr], None),
        "openk3_moe_combine": ([i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr], None),
    }
    if any(bind("moe.c", name, argtypes, restype) is None for name, (argtypes, restype) in signatures.items()):
        return None
    return load("moe.c")  # the library object now holds the typed functions


def route_cpu(
    logits_TE: torch.Tensor, bias_E: torch.Tensor | None, k: int, renormalize: bool, scaling: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(topk_idx [T, k] int64, topk_weight [T, k] fp32, scores [T, E] fp32) from fp32 router logits, as sigmoid_topk_route
    computes them, or None. The logits tensor becomes the scores (it is the caller's temporary). Ties in the biased score
    go to the lower expert id (torch.topk leaves their order unspecified); a NaN score is never selected."""
    if logits_TE.dim() != 2 or not logits_TE.is_contiguous() or not _inference_cpu_fp32(logits_TE, *([bias_E] if bias_E is not None else [])):
        return None  # checked before the library is asked for, so that other devices never build it
    lib = _lib()
    if lib is None:
        return None
    num_tokens, num_experts = logits_TE.shape
    if not 1 <= k <= min(num_experts, MAX_K) or (bias_E is not None and (not bias_E.is_contiguous() or bias_E.numel() != num_experts)):
        return None  # the torch path raises for what is invalid; k > MAX_K is valid and simply not ours
    idx = torch.empty(num_tokens, k, dtype=torch.int64)
    weight = torch.empty(num_tokens, k, dtype=torch.float32)
    bias_ptr = bias_E.data_ptr() if bias_E is not None else None
    lib.openk3_moe_route(num_tokens, num_experts, k, logits_TE.data_ptr(), bias_ptr, int(renormalize), scaling, idx.data_ptr(), weight.data_ptr())
    return idx, weight, logits_TE


def batched_experts_cpu(x_TD: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, bank: DenseExpertBank, act: Act) -> torch.Tensor | None:
    """moe_experts_batched's result with the whole stacked bank and the pair bookkeeping in C, or None (the caller's torch
    path then runs; also when fewer than half of the experts are active, where reading only those is cheaper)."""
    weights = (bank.w1_EID, bank.w3_EID, bank.w2_EDI)
    if x_TD.dim() != 2 or topk_idx.dim() != 2 or not _inference_cpu_fp32(x_TD, *weights) or x_TD.stride(-1) != 1:
        return None
    lib = _lib()
    if lib is None:
        return None
    num_tokens, k = topk_idx.shape
    num_experts, width = bank.num_experts, x_TD.shape[1]
    if x_TD.shape[0] != num_tokens or topk_weight.shape != topk_idx.shape or weights[0].shape[2] != width or not all(w.is_contiguous() for w in weights):
        return None  # moe_experts_batched checks the shapes first; the C loops trust them
    idx = topk_idx.to(torch.int64).contiguous()
    weight = topk_weight.to(torch.float32).contiguous()
    counts, slot_P = torch.empty(num_experts, dtype=torch.int64), torch.empty(idx.numel(), dtype=torch.int64)
    rows = lib.openk3_moe_plan(idx.numel(), num_experts, idx.data_ptr(), counts.data_ptr(), slot_P.data_ptr())
    if rows < 0:
        raise ValueError(f"moe experts: expert ids span {int(idx.min())}..{int(idx.max())}, expected 0..{num_experts - 1}")
    if 2 * int((counts > 0).sum()) < num_experts:
        return None
    x_ECD = x_TD.new_zeros(num_experts, rows, width)
    lib.openk3_moe_gather(idx.numel(), k, width, rows, idx.data_ptr(), slot_P.data_ptr(), x_TD.data_ptr(), x_TD.stride(0), x_ECD.data_ptr())
    out_ECD = bmm_weight_t(act(bmm_weight_t(x_ECD, weights[0]), bmm_weight_t(x_ECD, weights[1])), weights[2]).contiguous()
    y = torch.empty(num_tokens, width, dtype=torch.float32)
    lib.openk3_moe_combine(num_tokens, k, width, rows, idx.data_ptr(), slot_P.data_ptr(), weight.data_ptr(), out_ECD.data_ptr(), y.data_ptr())
    return y
