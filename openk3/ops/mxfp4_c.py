"""MXFP4 decode to fp32 in one C loop (ops/cpu/mxfp4.c): the "c" backend's "fast" form of "mxfp4_decode" (ops/registry.py).

Same tables as mxfp4.dequantize (decode_tables), so the same bits; a packed MoE layer decodes each picked expert with it at
every step (ops/moe/packed_bank.py), where the torch decode's per-byte gathers were most of a K3-width step's time.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from openk3.ops.cpu import require_inference
from openk3.ops.cpu.build import kernel
from openk3.ops.mxfp4 import DecodeTables, _check_packed, decode_tables


@functools.cache
def _kernel() -> Any:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return kernel("mxfp4.c", "openk3_mxfp4_decode", [i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ctypes.c_int], None)


def dequantize_c(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, tables: DecodeTables | None = None) -> torch.Tensor:
    """mxfp4.dequantize's contract for fp32 on CPU (what the "c" backend is chosen for); `tables` is accepted and unused
    beyond a check that it is fp32 (the kernel reads the fp32 tables itself)."""
    if dtype != torch.float32 or not packed.is_cpu or not scales.is_cpu:
        raise ValueError(f"dequantize_c: decodes to fp32 on CPU, got {dtype} on {packed.device}; choose the torch form elsewhere")
    if tables is not None and tables.scale_values.dtype != torch.float32:
        raise ValueError(f"dequantize_c: tables for {tables.scale_values.dtype}, expected decode_tables(torch.float32)")
    block = _check_packed(packed, scales)
    own = decode_tables(torch.float32, "cpu")
    require_inference("mxfp4 decode", own.scale_values)
    p, s = packed.contiguous(), scales.contiguous()
    rows, width = p.numel() // p.shape[-1], p.shape[-1]
    out = torch.empty(*p.shape[:-1], 2 * width, dtype=torch.float32)
    pairs = own.byte_pairs.view(torch.float32)  # [256] int64 -> [512] fp32: (even, odd) per byte
    _kernel()(rows, width, block, p.data_ptr(), s.data_ptr(), pairs.data_ptr(), own.scale_values.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out
