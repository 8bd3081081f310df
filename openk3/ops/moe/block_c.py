"""A latent MoE block after its router, as one op: y = up(norm(experts(down(x)))) + shared(x), the registry's
"moe_latent_block" -- `moe_latent_block_reference` ("naive", torch ops: the definition) and `moe_latent_block_c` ("fast" on
the "c" backend: ops/cpu/moe.c openk3_moe_latent_block); and with the router's top-k in the same call,
"moe_routed_latent_block" (`moe_routed_latent_block_reference`, `moe_routed_latent_block_c`: openk3_moe_routed_latent_block).

Legend: T tokens, D hidden, L latent width, I expert width, S shared-expert width, E experts, k experts per token.

Why: at decode sizes the block is ~10 kernel calls (latent down, the routed experts, the latent norm, latent up, the
shared experts' gate|up, activation and down, the sum), and on the demo model at 16 rows their Python and torch dispatch
cost more than their arithmetic: ~390 of a ~630 us MoE layer (issue 42, benchmarks/results/roofline.md). The C form runs
the same kernels' code (panels.h, rms_norm.h, glu.h, openk3_moe_packed_pairs) in one call, so its result equals the
separate calls' bit for bit (tests/ops/test_moe_block_c.py). The router's logits stay torch's GEMM, whose sums a C loop
would order differently (a different rounding can change which experts a token picks); the routed form takes the steps
after them (sigmoid, biased top-k, renormalisation: the C router's code) into the call, which saved the router's ~10
Python and torch calls per layer.
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
from openk3.ops.moe.cpu_pairs import _ACT_CODES, MAX_K, _glu_in_c
from openk3.ops.moe.naive import Act, check_moe_inputs, moe_experts_naive
from openk3.ops.moe.packed_bank import PackedMXFP4ExpertBank
from openk3.ops.moe.router import _logits, sigmoid_topk_route
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


def _argtypes(routing: list[Any]) -> list[Any]:
    """The C block's argument types: T and the sizes, x, the routing's arguments, then the weights (_block_args) and y."""
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    return [i64] * 7 + [ptr, i64, *routing] + [ptr] * 7 + [i32, f32, f32, ptr, f32, ptr, ptr, i32, f32, f32, ptr, ptr, i32]


@functools.cache
def _kernel() -> Any:
    return kernel("moe.c", "openk3_moe_latent_block", _argtypes([ctypes.c_void_p] * 2), ctypes.c_int)


@functools.cache
def _routed_kernel() -> Any:
    routing = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_float]  # logits, bias, renormalize, scaling
    return kernel("moe.c", "openk3_moe_routed_latent_block", _argtypes(routing), ctypes.c_int)


def _block_args(x_TD: torch.Tensor, w: LatentBlockWeights) -> tuple[torch.Tensor, tuple[Any, ...], tuple[Any, ...]]:
    """(x with unit column stride, the kernels' leading sizes after T and k's place, their weight arguments after the
    routing): the checks both C forms share."""
    if w.panels is None:
        raise ValueError("moe_latent_block_c: the weights carry no panel copies (LatentBlockWeights.panels)")
    experts = _glu_in_c(w.expert_act)
    shared = _ACT_CODES.get(w.shared_act)
    if experts is None or shared is None:
        raise ValueError(f"moe_latent_block_c: activations {w.expert_act!r} / {w.shared_act!r} are not ones moe.c knows")
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
    down, up, gate_up, shared_down = w.panels
    w1, w3, w2 = bank.w1, bank.w3, bank.w2
    norm = w.norm_L.data_ptr() if w.norm_L is not None else None
    sizes = (width, latent, bank.intermediate_size, shared_width, bank.num_experts)
    weights = (
        down.data_ptr(), w1.packed.data_ptr(), w1.scales.data_ptr(), w3.packed.data_ptr(), w3.scales.data_ptr(), w2.packed.data_ptr(),
        w2.scales.data_ptr(), *experts, norm, w.eps, up.data_ptr(), gate_up.data_ptr(), shared, w.shared_beta, w.shared_linear_beta,
        shared_down.data_ptr(),
    )  # fmt: skip
    return x_TD, sizes, weights


def moe_latent_block_c(x_TD: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, w: LatentBlockWeights) -> torch.Tensor:
    """The block in one C call, [T, D] fp32: needs `w.panels`, contiguous int64 ids and fp32 weights [T, k], an activation
    moe.c knows for both the experts and the shared experts."""
    check_moe_inputs(x_TD, topk_idx, topk_weight, w.bank, check_ids=False)  # the C plan checks the ids
    require_inference("moe latent block", x_TD, topk_weight)
    x_TD, sizes, weights = _block_args(x_TD, w)
    num_tokens, k = topk_idx.shape
    if topk_idx.dtype != torch.int64 or not topk_idx.is_contiguous() or topk_weight.dtype != torch.float32 or not topk_weight.is_contiguous():
        raise ValueError("moe_latent_block_c: topk_idx must be contiguous int64 and topk_weight contiguous fp32 (the C router's output)")
    y = x_TD.new_empty(num_tokens, sizes[0])
    if num_tokens == 0:
        return y
    status = _kernel()(
        num_tokens, *sizes, k, x_TD.data_ptr(), x_TD.stride(0), topk_idx.data_ptr(), topk_weight.data_ptr(), *weights, y.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if status < 0:
        raise ValueError(f"moe latent block: expert ids span {int(topk_idx.min())}..{int(topk_idx.max())}, expected 0..{w.bank.num_experts - 1}")
    if status:
        raise MemoryError("moe latent block: the C kernel could not allocate its scratch rows")
    return y


def moe_routed_latent_block_reference(
    x_TD: torch.Tensor, router_ED: torch.Tensor, bias_E: torch.Tensor | None, k: int, renormalize: bool, scaling: float, w: LatentBlockWeights
) -> torch.Tensor:
    """The definition of "moe_routed_latent_block": the router in torch ops, then moe_latent_block_reference."""
    routing = sigmoid_topk_route(x_TD, router_ED, bias_E, k, renormalize, scaling)
    return moe_latent_block_reference(x_TD, routing.topk_idx, routing.topk_weight, w)


def moe_routed_latent_block_c(
    x_TD: torch.Tensor, router_ED: torch.Tensor, bias_E: torch.Tensor | None, k: int, renormalize: bool, scaling: float, w: LatentBlockWeights
) -> torch.Tensor:
    """sigmoid_topk_route_c's routing, then moe_latent_block_c, with the steps after the router's logits in one C call:
    the same logits (torch's product, router.py `_logits`), the same C top-k and block code, so the same bits. [T, D] fp32;
    1 <= k <= MAX_K."""
    num_experts = w.bank.num_experts
    if router_ED.shape[0] != num_experts or not 1 <= k <= min(MAX_K, num_experts):
        raise ValueError(f"moe_routed_latent_block_c: a router of {router_ED.shape[0]} experts and k={k} for {num_experts} experts (k in 1..{MAX_K})")
    logits = _logits(x_TD, router_ED, bias_E, k)
    bias = None if bias_E is None else bias_E.float().contiguous()
    require_inference("moe latent block", x_TD, logits, *(() if bias is None else (bias,)))
    x_TD, sizes, weights = _block_args(x_TD, w)
    logits = logits.contiguous()
    y = x_TD.new_empty(x_TD.shape[0], sizes[0])
    if x_TD.shape[0] == 0:
        return y
    status = _routed_kernel()(
        x_TD.shape[0], *sizes, k, x_TD.data_ptr(), x_TD.stride(0), logits.data_ptr(), None if bias is None else bias.data_ptr(),
        int(renormalize), scaling, *weights, y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status:  # the ids come from the router's own experts: only memory can fail
        raise MemoryError("moe routed latent block: the C kernel could not allocate its scratch rows")
    return y
