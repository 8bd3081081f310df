"""Routed experts of a packed MXFP4 bank at decode sizes in one C call (ops/cpu/moe.c openk3_moe_experts_glu_mxfp4): the
"c" backend's form for PackedMXFP4ExpertBank, which moe_experts_sized picks where moe.c knows the activation.

Legend: T tokens, E experts, k experts per token, D expert input width, I expert intermediate width, C rows per expert.

Why: the torch forms decode one expert at a time (ops/mxfp4.py's dequantize: a gather, a multiply and a copy per weight)
and run its MLP as three small products; on the demo model that is ~0.15 ms per active expert, almost all of it dispatch,
and it grows with the number of distinct experts a step touches -- which a speculative verification multiplies (k + 1
tokens per sequence route to up to k + 1 times the experts). Here the pair bookkeeping of moe_experts_batched_c (plan,
gather, combine) and, per active expert, the three products run in one C call (openk3_moe_packed_pairs: no torch
allocation or host round trip between them), decoding the weights in registers (ops/cpu/mxfp4_rows.h): no expert is written
out in fp32 (issue 42: at K3's widths that write, 132 MiB per picked expert, was most of the routed experts' time; on the
demo model decoding a batch-16 step's picked experts into a dense bank and multiplying it was 3-6x this). The decoded
weights equal dequantize's bit for bit (every code x scale product is exact in fp32) and the sums are the dense C loop's,
so the result equals moe_experts_batched_c on the dequantized bank bit for bit (tests/ops/test_moe_packed_c.py).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from openk3.ops.cpu import require_inference
from openk3.ops.cpu.build import kernel
from openk3.ops.moe.bank import ExpertBank
from openk3.ops.moe.cpu_pairs import _glu_in_c
from openk3.ops.moe.naive import Act, check_moe_inputs
from openk3.ops.moe.packed_bank import PackedMXFP4ExpertBank
from openk3.ops.mxfp4 import MX_BLOCK


@functools.cache
def _experts_kernel() -> Any:
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    argtypes = [i64, i64, i64, i64, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ctypes.c_int, f32, f32, ptr, ctypes.c_int]
    return kernel("moe.c", "openk3_moe_packed_pairs", argtypes, ctypes.c_int)


def packed_c_fits(x_TD: torch.Tensor, bank: ExpertBank, act: Act) -> bool:
    """The C loop takes these inputs: a packed MXFP4 bank on the CPU with contiguous codes and scales, fp32 rows, and an
    activation moe.c knows."""
    if not isinstance(bank, PackedMXFP4ExpertBank) or x_TD.dim() != 2 or x_TD.dtype != torch.float32 or _glu_in_c(act) is None:
        return False
    tensors = [t for w in (bank.w1, bank.w3, bank.w2) for t in (w.packed, w.scales)]
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) and bank.width % MX_BLOCK == 0 and bank.intermediate_size % MX_BLOCK == 0


def moe_experts_packed_c(x_TD: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, bank: ExpertBank, act: Act) -> torch.Tensor:
    """sum_j w[t, j] * expert_{idx[t, j]}(x[t]) for a packed MXFP4 bank, [T, D] fp32 (the caller checked packed_c_fits)."""
    check_moe_inputs(x_TD, topk_idx, topk_weight, bank, check_ids=False)  # openk3_moe_plan checks the ids
    if not isinstance(bank, PackedMXFP4ExpertBank):
        raise TypeError(f"moe_experts_packed_c needs a PackedMXFP4ExpertBank, got {type(bank).__name__}")
    require_inference("moe experts", x_TD)
    glu_c = _glu_in_c(act)
    if glu_c is None:
        raise ValueError("moe_experts_packed_c: the activation is not one moe.c knows (packed_c_fits)")
    num_tokens, k = topk_idx.shape
    num_experts, width, inner = bank.num_experts, bank.width, bank.intermediate_size
    if x_TD.shape[1] != width:
        raise ValueError(f"moe experts: input width {x_TD.shape[1]}, the packed bank's experts take {width}")
    if num_tokens == 0:
        return torch.zeros_like(x_TD)
    x_TD = x_TD if x_TD.stride(-1) == 1 else x_TD.contiguous()
    idx = topk_idx if topk_idx.dtype == torch.int64 and topk_idx.is_contiguous() else topk_idx.to(torch.int64).contiguous()
    weight = topk_weight if topk_weight.dtype == torch.float32 and topk_weight.is_contiguous() else topk_weight.to(torch.float32).contiguous()
    y = x_TD.new_empty(num_tokens, width)
    code, beta, linear_beta = glu_c
    w1, w3, w2 = bank.w1, bank.w3, bank.w2
    status = _experts_kernel()(
        num_tokens, k, num_experts, width, inner, x_TD.data_ptr(), x_TD.stride(0), idx.data_ptr(), weight.data_ptr(),
        w1.packed.data_ptr(), w1.scales.data_ptr(), w3.packed.data_ptr(), w3.scales.data_ptr(), w2.packed.data_ptr(), w2.scales.data_ptr(),
        code, beta, linear_beta, y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status < 0:
        raise ValueError(f"moe experts: expert ids span {int(idx.min())}..{int(idx.max())}, expected 0..{num_experts - 1}")
    if status:
        raise MemoryError("moe experts: the C expert loop could not allocate its scratch rows")
    return y
