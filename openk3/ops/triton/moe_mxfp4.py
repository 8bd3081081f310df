"""Routed experts from packed MXFP4 weights by a Triton grouped GEMM: the codes and scales are decoded in registers,
tile by tile, inside the matmul; no expert's weights are ever written out in full precision.

Legend: T tokens, k slots per token, P = T * k (token, slot) pairs, D expert input width, I expert intermediate width,
E experts, BM rows per tile (pairs of one expert), N / K a product's output / input width.

The pairs are sorted by expert (a stable sort, as ops/moe/grouped.py) and each expert's slice is cut into tiles of BM
rows; the tile -> (expert, first row, end row) table is computed on the device from bincount and cumsum, sized by an
upper bound known on the host (sum over experts of ceil(count / BM) <= min(P, ceil(P / BM) + E)), so the launch needs no
host sync; tiles past the real ones have no rows and return at once. Three launches make one expert MLP:
gate and up (x rows gathered by token), the activation in torch (any `Act`), and down, whose kernel scales each row by its
routing weight and writes it to the pair's own row, so the k slots of a token are summed by a plain reduction (no atomics,
deterministic). Products accumulate in fp32; h is rounded to x's dtype as ops/moe/naive.py's expert_forward does.

A tile's K loop loads x [BM, BK] and splits it into even and odd columns, which meet the low and high nibbles of the
packed bytes [BN, BK / 2]: the decode never has to interleave the two halves back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops.moe.bank import ExpertBank
from openk3.ops.moe.naive import Act, check_moe_inputs
from openk3.ops.moe.packed_bank import PackedMXFP4ExpertBank
from openk3.ops.mxfp4 import MX_BLOCK, MXFP4Tensor
from openk3.ops.triton import interpreting, require_launchable
from openk3.ops.triton.mxfp4_decode import decode_pairs, to_dtype_exact

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64  # BM is tl.dot's smallest M; BK a multiple of the MX block (whole scales per tile)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _grouped_mxfp4_gemm(
    a_ptr, a_row_ptr, w_ptr, s_ptr, out_ptr, out_row_ptr, row_weight_ptr,
    tile_expert_ptr, tile_start_ptr, tile_end_ptr,
    N, K, stride_a, stride_we, stride_wn, stride_se, stride_sn, stride_o,
    GATHER_A: tl.constexpr, SCATTER_OUT: tl.constexpr, ROW_WEIGHT: tl.constexpr, PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_BYTES: tl.constexpr,
):  # fmt: skip
    """out[row] (x row_weight[row]) = a[a_row[row]] @ W_e^T over the rows of one tile, all of expert e."""
    tile = tl.program_id(0)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    if start >= end:
        return
    e = tl.load(tile_expert_ptr + tile).to(tl.int64)
    rows = start + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    a_rows = rows
    if GATHER_A:
        a_rows = tl.load(a_row_ptr + rows, mask=row_mask, other=0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    half_k = K // 2
    w_rows = w_ptr + e * stride_we + n[:, None] * stride_wn
    s_rows = s_ptr + e * stride_se + n[:, None] * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptr + a_rows[:, None].to(tl.int64) * stride_a + kk[None, :], mask=row_mask[:, None] & (kk[None, :] < K), other=0.0)
        a_even, a_odd = tl.split(tl.reshape(a.to(DOT_DTYPE), (BLOCK_M, BLOCK_K // 2, 2)))
        jb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        byte = tl.load(w_rows + jb[None, :], mask=n_mask[:, None] & (jb[None, :] < half_k), other=0)
        g = k0 // (2 * GROUP_BYTES) + tl.arange(0, BLOCK_K // (2 * GROUP_BYTES))
        scale = tl.load(s_rows + g[None, :], mask=n_mask[:, None] & (g[None, :] < half_k // GROUP_BYTES), other=0)
        w_even, w_odd = decode_pairs(byte, scale, BLOCK_N, BLOCK_K // 2, GROUP_BYTES)
        w_even = to_dtype_exact(w_even, DOT_DTYPE)
        w_odd = to_dtype_exact(w_odd, DOT_DTYPE)
        acc += tl.dot(a_even, tl.trans(w_even), input_precision=PRECISION)
        acc += tl.dot(a_odd, tl.trans(w_odd), input_precision=PRECISION)
    if ROW_WEIGHT:
        acc = acc * tl.load(row_weight_ptr + rows, mask=row_mask, other=0.0)[:, None]
    out_rows = rows
    if SCATTER_OUT:
        out_rows = tl.load(out_row_ptr + rows, mask=row_mask, other=0)
    out = out_ptr + out_rows[:, None].to(tl.int64) * stride_o + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The dtype the tile products take: x's own, except under the interpreter, whose tl.dot misreads 16-bit floats
    (numpy has no bf16; triton 3.9 multiplies their raw bits), so there they go up to fp32. Either way a product of two
    16-bit values is exact in fp32 and the accumulation is fp32, so the sums agree to the order of the additions."""
    if dtype == torch.float32 or interpreting():
        return tl.float32
    return tl.bfloat16 if dtype == torch.bfloat16 else tl.float16


class Tiles:
    """The launch table: per tile its expert, first and end row in the expert-sorted pair order (int32, on the device)."""

    def __init__(self, sorted_experts_P: torch.Tensor, num_experts: int, block_m: int) -> None:
        pairs = sorted_experts_P.numel()
        # not bincount: on CUDA it reads the ids' max back to size its output, a sync (and fatal inside a graph capture)
        counts = torch.zeros(num_experts, dtype=torch.int64, device=sorted_experts_P.device)
        counts.scatter_add_(0, sorted_experts_P.long(), torch.ones_like(sorted_experts_P, dtype=torch.int64))
        seg_end = torch.cumsum(counts, 0)
        tiles_per_expert = (counts + block_m - 1) // block_m
        tile_end = torch.cumsum(tiles_per_expert, 0)
        self.num_tiles = min(pairs, triton.cdiv(pairs, block_m) + num_experts)  # host-known upper bound (module docstring)
        tile = torch.arange(self.num_tiles, device=sorted_experts_P.device)
        expert = torch.searchsorted(tile_end, tile, right=True)
        real = expert < num_experts
        expert = expert.clamp(max=num_experts - 1)
        local = tile - (tile_end[expert] - tiles_per_expert[expert])
        start = seg_end[expert] - counts[expert] + local * block_m
        end = torch.minimum(start + block_m, seg_end[expert])
        self.expert = expert.to(torch.int32)
        self.start = torch.where(real, start, 0).to(torch.int32)
        self.end = torch.where(real, end, 0).to(torch.int32)


def grouped_gemm(
    a: torch.Tensor,
    w: MXFP4Tensor,
    tiles: Tiles,
    out: torch.Tensor,
    a_rows: torch.Tensor | None = None,
    out_rows: torch.Tensor | None = None,
    row_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[r] = (row_weight[r] x) a[a_rows[r]] @ W_{e(r)}^T for every sorted pair row r (W packed [E, N, K/2] + scales)."""
    n, k = w.packed.shape[1], 2 * w.packed.shape[2]
    unused = tiles.start  # a pointer the kernel never reads when the matching flag is off
    grid = (tiles.num_tiles, triton.cdiv(n, BLOCK_N))
    _grouped_mxfp4_gemm[grid](
        a, unused if a_rows is None else a_rows, w.packed, w.scales, out,
        unused if out_rows is None else out_rows, unused if row_weight is None else row_weight,
        tiles.expert, tiles.start, tiles.end,
        n, k, a.stride(0), w.packed.stride(0), w.packed.stride(1), w.scales.stride(0), w.scales.stride(1), out.stride(0),
        GATHER_A=a_rows is not None, SCATTER_OUT=out_rows is not None, ROW_WEIGHT=row_weight is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32", DOT_DTYPE=dot_dtype(a.dtype),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_BYTES=MX_BLOCK // 2,
    )  # fmt: skip
    return out


def moe_experts_mxfp4(x_TD: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, bank: ExpertBank, act: Act) -> torch.Tensor:
    """The routed experts' weighted sum [T, D], as ops/moe/naive.py defines it, for a PackedMXFP4ExpertBank."""
    if not isinstance(bank, PackedMXFP4ExpertBank):
        raise TypeError(
            f"moe_experts 'triton' reads packed MXFP4 experts (PackedMXFP4ExpertBank), got {type(bank).__name__}: "
            "choose 'sized' or 'fast' for full-precision experts"
        )
    check_moe_inputs(x_TD, topk_idx, topk_weight, bank, check_ids=False)
    if x_TD.dtype not in _DTYPES:
        raise ValueError(f"moe_experts 'triton': x dtype {x_TD.dtype}, expected one of {list(_DTYPES)}")
    if x_TD.shape[1] != bank.width:
        raise ValueError(f"moe_experts 'triton': x width {x_TD.shape[1]}, expected the bank's input width {bank.width}")
    require_launchable("moe_experts 'triton'", x_TD, topk_idx, topk_weight, bank.w1.packed, bank.w2.packed)
    num_experts = bank.num_experts
    # the id range checked on the device: an error, not a host sync
    torch._assert_async(((topk_idx >= 0) & (topk_idx < num_experts)).all(), f"moe_experts 'triton': expert ids outside 0..{num_experts - 1}")
    t, k = topk_idx.shape
    pairs = t * k
    x_TD = x_TD.contiguous()
    if pairs == 0:
        return torch.zeros_like(x_TD)
    sorted_P, order_P = torch.sort(topk_idx.reshape(-1), stable=True)
    tiles = Tiles(sorted_P, num_experts, BLOCK_M)
    token_P = (order_P // k).to(torch.int32)
    weight_P = topk_weight.reshape(-1).float().index_select(0, order_P).contiguous()
    inter = bank.intermediate_size
    gate = grouped_gemm(x_TD, bank.w1, tiles, x_TD.new_empty(pairs, inter), a_rows=token_P)
    up = grouped_gemm(x_TD, bank.w3, tiles, x_TD.new_empty(pairs, inter), a_rows=token_P)
    h_PI = act(gate, up).to(x_TD.dtype).contiguous()
    out_PD = torch.empty(pairs, bank.width, dtype=torch.float32, device=x_TD.device)
    grouped_gemm(h_PI, bank.w2, tiles, out_PD, out_rows=order_P.to(torch.int32), row_weight=weight_P)
    return out_PD.view(t, k, -1).sum(dim=1).to(x_TD.dtype)
