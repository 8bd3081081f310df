"""The whole KDA decode token on CPU in one call: the fused C kernel of ops/cpu/kda_decode.c.

Legend: N sequences, H heads, D head dim, P = H * D, W short-conv width, S pool slots.

Why: after the input projections, a KDA layer's decode token is ~80 small torch ops (conv window, SiLU, two L2 norms, the
gate, the delta-rule read and update, the output norm and gate). At serving batch sizes each costs a few microseconds of
dispatch for nanoseconds of arithmetic, so on CPU they are most of the layer's time. The kernel does the same steps per
(sequence, head) in one pass, addressing the conv-window and state pools through the slot ids (no gather or scatter).

It is the "c" backend's "kda_decode" (ops/registry.py; the layer reads the resolved name, model/kda.py), beside the torch
ops it is tested against. A call outside what it was chosen for (autograd on, not CPU fp32) or with tensors laid out other
than the layer lays them out raises, having touched nothing.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from openk3.config import KDAGate
from openk3.ops.cpu import cpu_fp32, require_inference
from openk3.ops.cpu.build import kernel

MAX_HEAD_DIM = 512  # the kernel keeps a head's vectors on the stack (MAX_D in kda_decode.c)


@functools.cache
def _kernel() -> Any:
    """The ctypes function, built and loaded once per process (the "c" backend's entry only)."""
    i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    argtypes = [i64, i64, i64, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, i32, f32, f32, ptr, f32, ptr, i64, ptr, i32]
    return kernel("kda_decode.c", "openk3_kda_decode_step", argtypes, i32)


def _rows(t: torch.Tensor, n: int, width: int) -> bool:
    """[n, width] fp32 CPU with unit inner stride (rows may be views into a wider projection output)."""
    return t.shape == (n, width) and t.stride(1) == 1 and cpu_fp32(t)


def _dense(t: torch.Tensor, shape: tuple[int, ...]) -> bool:
    return t.shape == shape and t.is_contiguous() and cpu_fp32(t)


def kda_decode_fused(
    x_pre_NC: torch.Tensor,
    conv_weight_CW: torch.Tensor,
    conv_pool_SCW: torch.Tensor,
    slots_N: torch.Tensor,
    fresh_N: torch.Tensor | None,
    f_NP: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    b_NH: torch.Tensor,
    state_pool_SHDD: torch.Tensor,
    gate_kind: KDAGate,
    lower_bound: float | None,
    norm_weight_D: torch.Tensor,
    norm_eps: float,
    out_gate_NP: torch.Tensor,
) -> torch.Tensor:
    """Advance the slots' conv windows and states in place by one token each; returns the normalised, gated output [N, P]
    (fp32). Head dims up to MAX_HEAD_DIM (the layer chooses the torch ops above that)."""
    require_inference("kda decode", x_pre_NC, conv_weight_CW, conv_pool_SCW, f_NP, A_log, dt_bias, b_NH, state_pool_SHDD, norm_weight_D, out_gate_NP)
    n = slots_N.numel()
    num_slots, h, d, _ = state_pool_SHDD.shape
    p, width = h * d, conv_weight_CW.shape[-1]
    ok = (
        _rows(x_pre_NC, n, 3 * p)
        and _dense(conv_weight_CW, (3 * p, width))
        and _dense(conv_pool_SCW, (num_slots, 3 * p, width - 1))
        and _dense(state_pool_SHDD, (num_slots, h, d, d))
        and _rows(f_NP, n, p)
        and _rows(b_NH, n, h)
        and _rows(out_gate_NP, n, p)
        and _dense(A_log, A_log.shape) and A_log.numel() == h  # the kernel reads them as flat arrays ([H] or [1, 1, H, 1];
        and _dense(dt_bias, dt_bias.shape) and dt_bias.numel() == p  # [P] or [H, K])
        and _dense(norm_weight_D, (d,))
        and slots_N.dtype == torch.int64 and slots_N.is_cpu and slots_N.is_contiguous()
        and (fresh_N is None or (fresh_N.dtype == torch.bool and fresh_N.is_cpu and fresh_N.is_contiguous() and fresh_N.numel() == n))
        and (gate_kind == KDAGate.SOFTPLUS or lower_bound is not None)
        and d <= MAX_HEAD_DIM and width >= 1
    )  # fmt: skip
    if not ok:
        named = (("x", x_pre_NC), ("conv weight", conv_weight_CW), ("conv pool", conv_pool_SCW), ("state pool", state_pool_SHDD))
        shapes = {name: tuple(t.shape) for name, t in named}
        raise ValueError(f"kda_decode_fused: tensors laid out other than the KDA layer lays them out ({shapes}, head dim {d} of at most {MAX_HEAD_DIM})")
    if n == 0:
        return torch.empty(0, p, dtype=torch.float32)
    low, high = (int(v) for v in torch.aminmax(slots_N))
    if low < 0 or high >= num_slots:  # the kernel writes through these ids: never let one point outside the pools
        raise ValueError(f"kda_decode_fused: slot ids span {low}..{high}, expected 0..{num_slots - 1}")
    out = torch.empty(n, p, dtype=torch.float32)
    fresh_ptr = None if fresh_N is None else fresh_N.view(torch.uint8).data_ptr()
    status = _kernel()(
        n, h, d, width,
        x_pre_NC.data_ptr(), x_pre_NC.stride(0),
        conv_weight_CW.data_ptr(), conv_pool_SCW.data_ptr(),
        slots_N.data_ptr(), fresh_ptr,
        f_NP.data_ptr(), f_NP.stride(0),
        A_log.data_ptr(), dt_bias.data_ptr(),
        b_NH.data_ptr(), b_NH.stride(0),
        state_pool_SHDD.data_ptr(),
        0 if gate_kind == KDAGate.SOFTPLUS else 1, float(lower_bound or 0.0), d**-0.5,
        norm_weight_D.data_ptr(), norm_eps,
        out_gate_NP.data_ptr(), out_gate_NP.stride(0),
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:  # the checks above admit only what the kernel takes
        raise AssertionError(f"kda_decode_fused: the kernel refused head dim {d} or conv width {width}")
    return out
