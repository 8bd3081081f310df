"""MXFP4 (OCP Microscaling Formats v1.0): E2M1 elements in blocks that share one E8M0 power-of-two scale.

Legend: x [..., n] values (n a multiple of the block, 32 in MX); packed uint8 [..., n/2]; scales uint8 E8M0 [..., n/block].
A block of 32 costs 32 x 4 + 8 = 136 bits: 4.25 bits per element.

Encoding, as the spec's section 6.3 conversion:
- scale: X = 2^shared_exp with shared_exp = floor(log2(amax)) - 2 (2 is E2M1's largest exponent, "floor" mode), clamped to
  [-127, 127] and stored biased by 127. "rceil" instead takes the smallest power of two with amax / X <= 6, so nothing
  saturates. A block whose amax is not finite (NaN or +-inf) gets 0xFF, the E8M0 NaN, and decodes to NaN throughout.
- elements: V / X rounded to the nearest E2M1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6), ties to the even code, saturating at +-6;
  code 8 + c is -value(c). Elements of a NaN block are stored as signed zeros.
- packing: two codes per byte, the even-index element in the low nibble (the K3 checkpoint, gpt-oss and torchao agree).

torchao's to_mx departs from the spec in three places, and tests/ops/test_mxfp4.py checks those blocks against the scalar
reference instead (all others bit for bit against torchao): it gives a block holding +-inf (and no NaN) a finite scale
instead of NaN; it divides blocks whose scale byte is 0 (amax < 2^-124) by 2^-126 instead of 2^-127; and its RCEIL
evaluates ceil(log2(amax / 6)) in fp32 floats, which misses an fp32 amax a few ulps above 6 x 2^k (we read exponent bits).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from enum import Enum
from typing import NamedTuple

import torch

MX_BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E2M1_EMAX = 2
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; codes 8..15 are their negatives
_SUPPORTED_INPUTS = (torch.float32, torch.bfloat16, torch.float16)


class ScaleMode(str, Enum):
    FLOOR = "floor"  # the spec's rule; the largest element may saturate to 6
    RCEIL = "rceil"  # round the scale up so that amax / X <= 6


class MXFP4Tensor(NamedTuple):
    packed: torch.Tensor  # uint8 [..., n/2]
    scales: torch.Tensor  # uint8 E8M0 [..., n/block]


def parse_scale_mode(scale_mode: str | ScaleMode) -> ScaleMode:
    try:
        return ScaleMode(scale_mode)
    except ValueError:
        raise ValueError(f"mxfp4 scale_mode {scale_mode!r}, expected one of {[m.value for m in ScaleMode]}") from None


def _check_values(x: torch.Tensor, block: int) -> None:
    if block <= 0 or block % 2:
        raise ValueError(f"mxfp4 block {block}, expected a positive even size (MX uses {MX_BLOCK})")
    if x.dtype not in _SUPPORTED_INPUTS:
        raise ValueError(f"mxfp4 quantize: dtype {x.dtype}, expected one of {list(_SUPPORTED_INPUTS)}")
    if x.dim() == 0 or x.shape[-1] % block:
        raise ValueError(f"mxfp4 quantize: last dimension of shape {tuple(x.shape)} must be a multiple of the block size {block}")


def _check_packed(packed: torch.Tensor, scales: torch.Tensor) -> int:
    """Validate a packed pair and return its block size (elements per scale)."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4 dequantize: packed {packed.dtype} and scales {scales.dtype}, expected uint8 and uint8 (E8M0)")
    if packed.dim() == 0 or packed.shape[:-1] != scales.shape[:-1] or scales.shape[-1] == 0:
        raise ValueError(f"mxfp4 dequantize: packed {tuple(packed.shape)} and scales {tuple(scales.shape)} must share leading dims")
    n = 2 * packed.shape[-1]
    if n % scales.shape[-1] or (n // scales.shape[-1]) % 2:
        raise ValueError(f"mxfp4 dequantize: {n} elements per row do not split into {scales.shape[-1]} even blocks")
    return n // scales.shape[-1]


def _shared_exponent(amax: torch.Tensor, mode: ScaleMode) -> torch.Tensor:
    """Unbiased, clamped shared exponent per block (int32) from the fp32 bits of a finite amax."""
    bits = amax.float().view(torch.int32)
    # A subnormal amax reads as 2^-127 here; its true floor(log2) is lower still, and both clamp to -127 below.
    exp = ((bits >> 23) & 0xFF) - E8M0_BIAS - E2M1_EMAX
    if mode is ScaleMode.RCEIL:
        # amax = m 2^f with m in [1, 2): amax / 6 <= 2^(f-2) iff m <= 1.5, otherwise the scale goes one step up.
        exp = exp + ((bits & 0x7FFFFF) > 0x400000).to(torch.int32)
    return exp.clamp(-E8M0_BIAS, E8M0_BIAS)


def _rounding_boundaries() -> torch.Tensor:
    """Midpoints between consecutive E2M1 magnitudes, counted strictly below |q|; a tie must land on the even code, so
    the midpoints whose lower code is odd move one fp32 ulp down (the tie then counts and rounds up)."""
    mids = torch.tensor([(a + b) / 2 for a, b in zip(E2M1_VALUES[:-1], E2M1_VALUES[1:], strict=True)], dtype=torch.float32)
    lower_code_odd = torch.arange(len(mids)) % 2 == 1
    return torch.where(lower_code_odd, torch.nextafter(mids, torch.zeros_like(mids)), mids)


_ROUNDING_BOUNDARIES = _rounding_boundaries()  # read-only constant [7] fp32 on CPU


def quantize(x: torch.Tensor, block: int = MX_BLOCK, scale_mode: str | ScaleMode = "floor") -> MXFP4Tensor:
    """Quantise along the last dimension. Returns (packed uint8 [..., n/2], scales uint8 E8M0 [..., n/block])."""
    mode = parse_scale_mode(scale_mode)
    _check_values(x, block)
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // block, block)
    amax = xb.abs().amax(dim=-1)  # NaN propagates
    finite = torch.isfinite(amax)
    exp = torch.where(finite, _shared_exponent(amax, mode), 0)
    scales = torch.where(finite, exp + E8M0_BIAS, E8M0_NAN).to(torch.uint8)
    # 1 / X built from its bits: exp <= 126 for any finite fp32 amax, so 2^-exp is a normal fp32 and the product is exact.
    inv_scale = ((E8M0_BIAS - exp) << 23).view(torch.float32)
    q = xb.abs() * inv_scale.unsqueeze(-1)
    magnitude = torch.bucketize(q, _ROUNDING_BOUNDARIES.to(x.device), out_int32=True)  # > 6 lands on code 7: saturation
    magnitude = torch.where(finite.unsqueeze(-1), magnitude, 0)
    codes = (magnitude | (torch.signbit(xb).to(torch.int32) << 3)).to(torch.uint8).reshape(x.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return MXFP4Tensor(packed, scales)


class DecodeTables(NamedTuple):
    """The fast decode's lookup tables for one compute dtype and device: build once with decode_tables, reuse freely."""

    byte_pairs: torch.Tensor  # [256] byte -> (even element, odd element) as one int32 (bf16 pair) or int64 (fp32 pair)
    scale_values: torch.Tensor  # [256] E8M0 byte -> 2^(byte - 127), NaN at 0xFF


def _element_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=dtype, device=device)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32


def _byte_pair_values() -> torch.Tensor:
    elements = _element_values(torch.float32, torch.device("cpu"))
    # byte b -> (value of its low nibble, value of its high nibble) = (even element, odd element)
    return torch.stack((elements.repeat(16), elements.repeat_interleave(16)), dim=-1).contiguous()


def _e8m0_values() -> torch.Tensor:
    values = torch.ldexp(torch.ones(256, dtype=torch.float64), torch.arange(256, dtype=torch.float64) - E8M0_BIAS)
    values[E8M0_NAN] = math.nan
    return values.float()  # 2^-127 is a subnormal in fp32 (and in bf16), still exact


# Read-only constants (fp32, CPU): decode_tables only converts them, which keeps per-expert decoding cheap.
_BYTE_PAIR_VALUES = _byte_pair_values()  # [256, 2]
_E8M0_VALUES = _e8m0_values()  # [256]


def decode_tables(dtype: torch.dtype, device: torch.device | str = "cpu") -> DecodeTables:
    """Tables for decoding to `dtype` (computed in bf16 or fp32; every table entry and product is exact in both), made
    once per dtype and device: a copy to a GPU at every expert's decode would be a host-to-device copy per expert, and
    one inside a CUDA graph capture fails."""
    return _decode_tables(dtype, torch.device(device))


@functools.cache
def _decode_tables(dtype: torch.dtype, device: torch.device) -> DecodeTables:
    compute = _compute_dtype(dtype)
    # Each byte's two elements are gathered as one integer twice the element width: half the gathers on CPU.
    pair_dtype = torch.int32 if compute == torch.bfloat16 else torch.int64
    pairs = _BYTE_PAIR_VALUES.to(device=device, dtype=compute).view(pair_dtype).reshape(256)
    return DecodeTables(pairs, _E8M0_VALUES.to(device=device, dtype=compute))


def dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, tables: DecodeTables | None = None) -> torch.Tensor:
    """Decode to `dtype`: one gather per byte yields both elements, then one multiply by the block scale.

    The products code value x 2^k are exact in fp32 and bf16 (at most 3 significant bits), so computing directly in
    those dtypes equals decoding in fp64 and rounding once; other dtypes go through fp32 and round once.
    Pass `tables` (from decode_tables with the same dtype and device) to skip rebuilding them on every call.
    """
    block = _check_packed(packed, scales)
    compute = _compute_dtype(dtype)
    if tables is None:
        tables = decode_tables(dtype, packed.device)
    elif tables.scale_values.dtype != compute or tables.scale_values.device != packed.device:
        raise ValueError(
            f"mxfp4 dequantize: tables for {tables.scale_values.dtype} on {tables.scale_values.device}, expected decode_tables({dtype}, {packed.device})"
        )
    values = tables.byte_pairs.index_select(0, packed.reshape(-1).int()).view(compute).reshape(*scales.shape, block)
    scale = tables.scale_values.index_select(0, scales.reshape(-1).int()).reshape(*scales.shape, 1)
    return values.mul_(scale).reshape(*packed.shape[:-1], 2 * packed.shape[-1]).to(dtype)


def dequantize_naive(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The plain decode (nibbles split, interleaved, fp64 arithmetic, one rounding); the fast path is tested against it."""
    block = _check_packed(packed, scales)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])
    values = _element_values(torch.float64, packed.device)[codes.long()]
    scale = torch.ldexp(torch.ones_like(scales, dtype=torch.float64), scales.to(torch.float64) - E8M0_BIAS)
    scale = torch.where(scales == E8M0_NAN, math.nan, scale)
    return (values * scale.repeat_interleave(block, dim=-1)).to(dtype)


def quantize_block_reference(values: Sequence[float], scale_mode: str | ScaleMode = "floor") -> tuple[int, list[int]]:
    """One block, scalar Python (fp64 holds every fp32 input and quotient exactly): (E8M0 scale byte, codes)."""
    mode = parse_scale_mode(scale_mode)
    if any(not math.isfinite(v) for v in values):
        return E8M0_NAN, [8 if math.copysign(1.0, v) < 0 else 0 for v in values]
    amax = max(abs(v) for v in values)
    if amax == 0.0:
        shared_exp = -E8M0_BIAS
    else:
        shared_exp = math.floor(math.log2(amax)) - E2M1_EMAX
        while 2.0**shared_exp * 4 > amax:  # guard log2's rounding: 2^(shared_exp + 2) <= amax < 2^(shared_exp + 3)
            shared_exp -= 1
        while 2.0 ** (shared_exp + 3) <= amax:
            shared_exp += 1
        if mode is ScaleMode.RCEIL:
            while amax / 2.0**shared_exp > E2M1_MAX:
                shared_exp += 1
    shared_exp = max(-E8M0_BIAS, min(E8M0_BIAS, shared_exp))
    codes = []
    for v in values:
        q = abs(v) / 2.0**shared_exp
        # nearest grid value; on a tie the smaller distance key (distance, code parity) picks the even code
        magnitude = min(range(len(E2M1_VALUES)), key=lambda c: (abs(E2M1_VALUES[c] - q), c % 2))
        codes.append(magnitude | (8 if math.copysign(1.0, v) < 0 else 0))
    return shared_exp + E8M0_BIAS, codes


def dequantize_block_reference(scale_byte: int, codes: Sequence[int]) -> list[float]:
    if scale_byte == E8M0_NAN:
        return [math.nan] * len(codes)
    scale = 2.0 ** (scale_byte - E8M0_BIAS)
    return [(-1.0 if c & 8 else 1.0) * E2M1_VALUES[c & 7] * scale for c in codes]


def from_gpt_oss(blocks: torch.Tensor, scales: torch.Tensor) -> MXFP4Tensor:
    """gpt-oss `*_blocks` uint8 [..., rows, K/32, 16] + `*_scales` uint8 [..., rows, K/32] -> K3 [..., rows, K/2] + scales.

    gpt-oss packs the same way (the even element of each pair in the low nibble, 16 bytes per block of 32, E8M0 bias
    127), so the conversion is a reshape of the last two dims; scales pass through unchanged.
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"gpt-oss mxfp4: blocks {blocks.dtype}, scales {scales.dtype}, expected uint8 and uint8")
    if blocks.dim() < 2 or blocks.shape[-1] != MX_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"gpt-oss mxfp4: blocks {tuple(blocks.shape)}, scales {tuple(scales.shape)}, expected [..., rows, K/32, 16] and [..., rows, K/32]")
    return MXFP4Tensor(blocks.reshape(*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1]), scales)


def to_gpt_oss(t: MXFP4Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K3 layout -> gpt-oss (`*_blocks` [..., rows, K/32, 16], `*_scales` [..., rows, K/32]); inverse of from_gpt_oss."""
    packed, scales = t
    if _check_packed(packed, scales) != MX_BLOCK:
        raise ValueError(f"gpt-oss mxfp4: packed {tuple(packed.shape)} with scales {tuple(scales.shape)} is not in blocks of {MX_BLOCK}")
    return packed.reshape(*scales.shape, MX_BLOCK // 2), scales


def mxfp4_nbytes(t: MXFP4Tensor) -> int:
    return t.packed.numel() * t.packed.element_size() + t.scales.numel() * t.scales.element_size()
