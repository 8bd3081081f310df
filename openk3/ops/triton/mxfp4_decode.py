"""MXFP4 decode inside Triton kernels: E2M1 codes and E8M0 scales to fp32 from their bits, and a dequantising kernel that
proves the decode bit for bit against ops/mxfp4.py (the grouped GEMM of moe_mxfp4.py calls the same helpers).

Legend: packed uint8 [R, C/2] (the even element of a pair in the low nibble), scales uint8 E8M0 [R, C/32], out [R, C].

Both decodes build the fp32 bit pattern instead of looking values up, so no table lives in memory:
- E2M1 code s e1 e0 m: exponent field e = e1 e0; e > 0 is 2^(e - 1) (1 + m / 2), fp32 bits (e + 126) << 23 | m << 22;
  e == 0 is the subnormal m / 2, which is 0.5 (bits 126 << 23) or zero; the sign goes to bit 31.
- E8M0 byte b: 2^(b - 127), fp32 bits b << 23 for b >= 1; b == 0 is 2^-127, an fp32 subnormal (bits 1 << 22); 0xFF is NaN.
The product of the two has at most 3 significant bits, so it is exact in fp32 (and in bf16), as ops/mxfp4.py's decode is.
It goes to bf16 by dropping the low 16 bits (exact for such values, subnormals included) rather than by a float conversion:
Triton's interpreter flushes bf16 subnormals in its conversion, and the tests must see the bits the GPU computes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops.mxfp4 import E8M0_NAN, MX_BLOCK, _check_packed
from openk3.ops.triton import require_launchable


@triton.jit
def e2m1_to_f32(code):
    """code: uint32 nibbles 0..15 -> their fp32 values."""
    exponent = (code >> 1) & 3
    mantissa = code & 1
    normal = ((exponent + 126) << 23) | (mantissa << 22)
    bits = tl.where(exponent > 0, normal, mantissa * (126 << 23))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_to_f32(scale):
    """scale: uint32 bytes 0..255 -> 2^(scale - 127) in fp32, NaN for 0xFF."""
    bits = tl.where(scale == 0, 1 << 22, scale << 23)
    return tl.where(scale == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def to_dtype_exact(x, dtype: tl.constexpr):
    """fp32 values with at most 8 significant bits -> `dtype`; bf16 by its bits, other dtypes by one rounding."""
    if dtype == tl.bfloat16:
        return (x.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def decode_pairs(byte, scale, BLOCK_ROWS: tl.constexpr, BLOCK_BYTES: tl.constexpr, GROUP_BYTES: tl.constexpr):
    """byte uint8 [BLOCK_ROWS, BLOCK_BYTES], scale uint8 [BLOCK_ROWS, BLOCK_BYTES // GROUP_BYTES] (one per GROUP_BYTES
    bytes) -> (even elements, odd elements), fp32 [BLOCK_ROWS, BLOCK_BYTES] each."""
    b = byte.to(tl.uint32)
    s = e8m0_to_f32(scale.to(tl.uint32))[:, :, None]
    groups: tl.constexpr = BLOCK_BYTES // GROUP_BYTES
    lo = tl.reshape(e2m1_to_f32(b & 15), (BLOCK_ROWS, groups, GROUP_BYTES)) * s
    hi = tl.reshape(e2m1_to_f32(b >> 4), (BLOCK_ROWS, groups, GROUP_BYTES)) * s
    return tl.reshape(lo, (BLOCK_ROWS, BLOCK_BYTES)), tl.reshape(hi, (BLOCK_ROWS, BLOCK_BYTES))


@triton.jit
def _dequantize_kernel(
    packed_ptr, scales_ptr, out_ptr, rows, half_cols, stride_p, stride_s, stride_o,
    BLOCK_ROWS: tl.constexpr, BLOCK_BYTES: tl.constexpr, GROUP_BYTES: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    j = tl.program_id(1) * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    g = tl.program_id(1) * (BLOCK_BYTES // GROUP_BYTES) + tl.arange(0, BLOCK_BYTES // GROUP_BYTES)
    mask = (r[:, None] < rows) & (j[None, :] < half_cols)
    byte = tl.load(packed_ptr + r[:, None] * stride_p + j[None, :], mask=mask, other=0)
    smask = (r[:, None] < rows) & (g[None, :] < half_cols // GROUP_BYTES)
    scale = tl.load(scales_ptr + r[:, None] * stride_s + g[None, :], mask=smask, other=0)
    even, odd = decode_pairs(byte, scale, BLOCK_ROWS, BLOCK_BYTES, GROUP_BYTES)
    out = out_ptr + r[:, None] * stride_o + 2 * j[None, :]
    tl.store(out, to_dtype_exact(even, out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + 1, to_dtype_exact(odd, out_ptr.dtype.element_ty), mask=mask)


def dequantize_triton(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """ops/mxfp4.dequantize for 2-D [R, C/2] + [R, C/32] by the kernel's decode (blocks of 32 only, as in K3's experts)."""
    if packed.dim() != 2 or _check_packed(packed, scales) != MX_BLOCK:
        raise ValueError(f"mxfp4 dequantize (triton): packed {tuple(packed.shape)}, scales {tuple(scales.shape)}, expected [R, C/2] and [R, C/{MX_BLOCK}]")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"mxfp4 dequantize (triton): dtype {dtype}, expected float32, bfloat16 or float16")
    require_launchable("mxfp4 dequantize", packed, scales)
    packed, scales = packed.contiguous(), scales.contiguous()
    rows, half_cols = packed.shape
    out = torch.empty(rows, 2 * half_cols, dtype=dtype, device=packed.device)
    block_rows, block_bytes = 16, 64
    grid = (triton.cdiv(rows, block_rows), triton.cdiv(half_cols, block_bytes))
    _dequantize_kernel[grid](
        packed, scales, out, rows, half_cols, packed.stride(0), scales.stride(0), out.stride(0),
        BLOCK_ROWS=block_rows, BLOCK_BYTES=block_bytes, GROUP_BYTES=MX_BLOCK // 2,
    )  # fmt: skip
    return out


assert E8M0_NAN == 255  # e8m0_to_f32 spells the NaN byte as a literal (a jit function reads no Python globals)
