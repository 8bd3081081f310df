"""A KDA layer's decode token from the layer's input to its output projection, as one op: the registry's
"kda_layer_decode" -- `kda_layer_decode_reference` ("naive": the projections in torch and the decode step's definition) and
`kda_layer_decode_c` ("fast" on the "c" backend: ops/cpu/kda_decode.c openk3_kda_layer_decode). Full-rank output gate
only (K3's and the demo model's).

Legend: N sequences (one token each), Dm model width, H heads, K = V head dim, P = H * K; the fused input projection's
rows are q | k | v (3P), f_a (K), g (P), b (H), as model/kda.py's ProjectionGroup orders them.

Why: around the fused decode kernel (ops/kda/decode_fused.py) a KDA layer still made four projection calls, the split
views and the kernel's checks from Python; on the demo model at 16 rows that dispatch cost about as much as the
arithmetic (issue 42, benchmarks/results/roofline.md). The C form runs the same code (panels.h and the decode kernel) in
the same order, so its result and the states it leaves equal the separate calls' bit for bit (tests/ops/test_kda_layer_c.py).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from openk3.config import KDAGate
from openk3.ops.cpu import require_inference
from openk3.ops.cpu.build import kernel
from openk3.ops.kda.decode_fused import MAX_HEAD_DIM
from openk3.ops.kda.decode_step import KDALayerWeights, KDASlots, kda_decode_step_naive


class KDALayerDecodeWeights(NamedTuple):
    """A KDA layer's weights for the decode token. `panels`: the C form's panel copies (ops/linear.py pack_panels) of
    (in_proj, f_b, o_proj), None for the torch form."""

    in_proj_ND: torch.Tensor  # [3P + K + P + H, Dm]
    f_b_PK: torch.Tensor
    o_proj_DP: torch.Tensor
    layer: KDALayerWeights
    heads: int
    panels: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def _split(proj: torch.Tensor, heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    p = heads * head_dim
    return proj.split([3 * p, head_dim, p, heads], dim=-1)


def kda_layer_decode_reference(x_ND: torch.Tensor, w: KDALayerDecodeWeights, slots: KDASlots) -> torch.Tensor:
    """The definition: projections by F.linear, kda_decode_step_naive, o_proj; advances the slots as it does."""
    qkv, f_a, gate, b = _split(F.linear(x_ND, w.in_proj_ND), w.heads, w.f_b_PK.shape[1])
    return F.linear(kda_decode_step_naive(qkv, F.linear(f_a, w.f_b_PK), b, gate, w.layer, slots), w.o_proj_DP)


@functools.cache
def _kernel() -> Any:
    i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    argtypes = [i64] * 5 + [ptr, i64] + [ptr] * 9 + [i32, f32, f32, ptr, f32, ptr, ptr, i32]
    return kernel("kda_decode.c", "openk3_kda_layer_decode", argtypes, i32)


def _check(x_ND: torch.Tensor, w: KDALayerDecodeWeights, slots: KDASlots) -> None:
    """Everything the kernel reads or writes through is laid out as the layer lays it out; the slot ids stay in the pools."""
    lw, n = w.layer, x_ND.shape[0]
    num_slots, h, d, _ = slots.state_SHKV.shape
    p, width = h * d, lw.conv_weight_CW.shape[-1]
    dense = (lw.conv_weight_CW, slots.conv_SCW, slots.state_SHKV, lw.A_log, lw.dt_bias, lw.norm_weight_D, slots.slots_N)
    ok = (
        x_ND.dim() == 2 and x_ND.stride(1) == 1 and h == w.heads and d <= MAX_HEAD_DIM and width >= 1
        and w.in_proj_ND.shape == (4 * p + d + h, x_ND.shape[1]) and w.f_b_PK.shape == (p, d) and w.o_proj_DP.shape == (x_ND.shape[1], p)
        and lw.conv_weight_CW.shape == (3 * p, width) and slots.conv_SCW.shape == (num_slots, 3 * p, width - 1)
        and lw.A_log.numel() == h and lw.dt_bias.numel() == p and lw.norm_weight_D.shape == (d,)
        and all(t.is_contiguous() for t in dense)
        and slots.slots_N.dtype == torch.int64 and slots.slots_N.shape == (n,)
        and (slots.fresh_N is None or (slots.fresh_N.dtype == torch.bool and slots.fresh_N.is_contiguous() and slots.fresh_N.shape == (n,)))
        and (lw.gate == KDAGate.SOFTPLUS or lw.gate_lower_bound is not None)
    )  # fmt: skip
    if not ok:
        shapes = {"x": tuple(x_ND.shape), "in_proj": tuple(w.in_proj_ND.shape), "state pool": tuple(slots.state_SHKV.shape)}
        raise ValueError(f"kda_layer_decode_c: tensors laid out other than the KDA layer lays them out ({shapes}, head dim {d} of at most {MAX_HEAD_DIM})")
    low, high = (int(v) for v in torch.aminmax(slots.slots_N))
    if low < 0 or high >= num_slots:  # the kernel writes through these ids: never let one point outside the pools
        raise ValueError(f"kda_layer_decode_c: slot ids span {low}..{high}, expected 0..{num_slots - 1}")


def kda_layer_decode_c(x_ND: torch.Tensor, w: KDALayerDecodeWeights, slots: KDASlots) -> torch.Tensor:
    """The token in one C call, [N, Dm] fp32; advances the slots' conv windows and states in place (needs `w.panels`)."""
    lw = w.layer
    require_inference("kda layer decode", x_ND, lw.conv_weight_CW, slots.conv_SCW, slots.state_SHKV, lw.A_log, lw.dt_bias, lw.norm_weight_D)
    if w.panels is None:
        raise ValueError("kda_layer_decode_c: the weights carry no panel copies (KDALayerDecodeWeights.panels)")
    n, model_width = x_ND.shape
    y = x_ND.new_empty(n, model_width)
    if n == 0:
        return y
    _check(x_ND, w, slots)
    in_p, fb_p, o_p = w.panels
    d = w.f_b_PK.shape[1]
    fresh = None if slots.fresh_N is None else slots.fresh_N.view(torch.uint8).data_ptr()
    status = _kernel()(
        n, model_width, w.heads, d, lw.conv_weight_CW.shape[-1], x_ND.data_ptr(), x_ND.stride(0), in_p.data_ptr(), fb_p.data_ptr(),
        lw.conv_weight_CW.data_ptr(), slots.conv_SCW.data_ptr(), slots.slots_N.data_ptr(), fresh, lw.A_log.data_ptr(), lw.dt_bias.data_ptr(),
        slots.state_SHKV.data_ptr(), 0 if lw.gate == KDAGate.SOFTPLUS else 1, float(lw.gate_lower_bound or 0.0), d**-0.5,
        lw.norm_weight_D.data_ptr(), lw.norm_eps, o_p.data_ptr(), y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status == 2:
        raise MemoryError("kda_layer_decode_c: the C kernel could not allocate its scratch rows")
    if status:  # the checks above admit only what the kernel takes
        raise AssertionError(f"kda_layer_decode_c: the kernel refused head dim {d} or conv width {lw.conv_weight_CW.shape[-1]}")
    return y
