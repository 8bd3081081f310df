"""A latent MoE block after its router, as one op: y = up(norm(experts(down(x)))) + shared(x), the registry's
"moe_latent_block" -- `moe_latent_block_reference` ("naive", torch ops: the definition) and `moe_latent_block_c` ("fast" on
the "c" backend: ops/cpu/moe.c openk3_moe_latent_block).

Legend: T tokens, D hidden, L latent width, I expert width, S shared-expert width, E experts, k experts per token.

Why: at decode sizes the block is ~10 kernel calls (latent down, the routed experts, the latent norm, latent up, the
shared experts' gate|up, activation and down, the sum), and on the demo model at 16 rows their Python and torch dispatch
cost more than their arithmetic: ~390 of a ~630 us MoE layer (issue 42, benchmarks/results/roofline.md). The C form runs
the same kernels' code (panels.h, rms_norm.h, glu.h, openk3_moe_packed_pairs) in one call, so its result equals the
separate calls' bit for bit (tests/ops/test_moe_block_c.py). The router stays outside: its logits are torch's GEMM, whose
sums a C loop would order differently, and a different rounding can change which experts a token picks.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from openk3.config import Activation
from openk3.ops.activation import glu
from openk3.ops.cpu import require_inference
from openk3.ops.cpu.build import kernel
from openk3.ops.moe.cpu_pairs import _ACT_CODES, _glu_in_c
from openk3.ops.moe.naive import Act, check_moe_inputs, moe_experts_naive
from openk3.ops.moe.packed_bank import PackedMXFP4ExpertBank
from openk3.ops.norm import rms_norm_reference


class LatentBlockWeights(NamedTuple):
    """A latent MoE block's weights after its router. `panels`: the C form's panel copies (ops/linear.py pack_panels) of
    (down, up, gate_up, shared_down), None for the torch form."""

    down_LD: torch.Tensor
    bank: PackedMXFP4ExpertBank
    expert_act: Act
    norm_L: torch.Tensor | None
    eps: float
    up_DL: torch.Tensor
    gate_up_2SD: torch.Tensor  # the shared experts' gate rows, then their up rows
    shared_act: Activation
    shared_beta: float
    shared_linear_beta: float
    shared_down_DS: torch.Tensor
    panels: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def moe_latent_block_reference(x_TD: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, w: LatentBlockWeights) -> torch.Tensor:
    """The definition in torch ops, [T, D]."""
    z = moe_experts_naive(F.linear(x_TD, w.down_LD), topk_idx, topk_weight, w.bank, w.expert_act)
    if w.norm_L is not None:
        z = rms_norm_reference(z, w.norm_L, w.eps)
    gate, up = F.linear(x_TD, w.gate_up_2SD).chunk(2, dim=-1)
    return F.linear(z, w.up_DL) + F.linear(glu(gate, up, w.shared_act, w.shared_beta, w.shared_linear_beta), w.shared_down_DS)


@functools.cache
def _kernel() -> Any:
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    argtypes = [i64] * 7 + [ptr, i64, ptr, ptr, ptr] + [ptr] * 6 + [i32, f32, f32, ptr, f32, ptr, ptr, i32, f32, f32, ptr, ptr, i32]
    return kernel("moe.c", "openk3_moe_latent_block", argtypes, ctypes.c_int)


def moe_latent_block_c(x_TD: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, w: LatentBlockWeights) -> torch.Tensor:
    """The block in one C call, [T, D] fp32: needs `w.panels`, contiguous int64 ids and fp32 weights [T, k], an activation
    moe.c knows for both the experts and the shared experts."""
    check_moe_inputs(x_TD, topk_idx, topk_weight, w.bank, check_ids=False)  # the C plan checks the ids
    require_inference("moe latent block", x_TD, topk_weight)
    if w.panels is None:
        raise ValueError("moe_latent_block_c: the weights carry no panel copies (LatentBlockWeights.panels)")
    experts = _glu_in_c(w.expert_act)
    shared = _ACT_CODES.get(w.shared_act)
    if experts is None or shared is None:
        raise ValueError(f"moe_latent_block_c: activations {w.expert_act!r} / {w.shared_act!r} are not ones moe.c knows")
    num_tokens, k = topk_idx.shape
    latent, width = w.down_LD.shape
    shared_width = w.shared_down_DS.shape[1]
    bank = w.bank
    if x_TD.shape[1] != width or bank.width != latent or w.up_DL.shape != (width, latent) or w.gate_up_2SD.shape != (2 * shared_width, width):
        raise ValueError(
            f"moe latent block: x {tuple(x_TD.shape)}, down {tuple(w.down_LD.shape)}, experts of width {bank.width}, up {tuple(w.up_DL.shape)},"
            f" gate_up {tuple(w.gate_up_2SD.shape)}, shared down {tuple(w.shared_down_DS.shape)}: widths that do not chain"
        )
    if x_TD.stride(-1) != 1:
        x_TD = x_TD.contiguous()
    if topk_idx.dtype != torch.int64 or not topk_idx.is_contiguous() or topk_weight.dtype != torch.float32 or not topk_weight.is_contiguous():
        raise ValueError("moe_latent_block_c: topk_idx must be contiguous int64 and topk_weight contiguous fp32 (the C router's output)")
    y = x_TD.new_empty(num_tokens, width)
    if num_tokens == 0:
        return y
    down, up, gate_up, shared_down = w.panels
    w1, w3, w2 = bank.w1, bank.w3, bank.w2
    norm = w.norm_L.data_ptr() if w.norm_L is not None else None
    status = _kernel()(
        num_tokens, width, latent, bank.intermediate_size, shared_width, bank.num_experts, k, x_TD.data_ptr(), x_TD.stride(0),
        topk_idx.data_ptr(), topk_weight.data_ptr(), down.data_ptr(),
        w1.packed.data_ptr(), w1.scales.data_ptr(), w3.packed.data_ptr(), w3.scales.data_ptr(), w2.packed.data_ptr(), w2.scales.data_ptr(),
        *experts, norm, w.eps, up.data_ptr(), gate_up.data_ptr(), shared, w.shared_beta, w.shared_linear_beta, shared_down.data_ptr(),
        y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status < 0:
        raise ValueError(f"moe latent block: expert ids span {int(topk_idx.min())}..{int(topk_idx.max())}, expected 0..{bank.num_experts - 1}")
    if status:
        raise MemoryError("moe latent block: the C kernel could not allocate its scratch rows")
    return y
