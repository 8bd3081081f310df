"""MLA paged decode in the absorbed latent space, as a Triton kernel: the latent attention of ops/mla/absorbed.py's
mla_decode_paged (the registry's "mla_decode"/"triton" on cuda binds it there), read straight from the page pool.

Legend: N sequences, H heads, Lr kv_lora_rank, Dr qk_rope_head_dim, R = Lr + Dr latent row width, NP pages in the pool,
PS rows per page, P page-table width, BH heads per program, BS key rows per tile.

One program takes one sequence and BH heads: every head of MLA reads the same cached [c | k_pe] rows, so a tile of rows
is loaded once for BH heads, and no per-head K or V is ever formed. Each key row is found through the page table
(row s of a sequence lives in page table[n, s // PS], slot s % PS), tile by tile up to kv_lens[n], with the running
max / sum of an online softmax, so the scores never exist for the whole context. The c columns and the k_pe columns are
two products (each a power-of-two width in K3: 512 and 64); the weighted sum is over c only, which is u.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops.triton import interpreting, require_launchable
from openk3.ops.triton.online_softmax import online_softmax_step

BLOCK_H, BLOCK_S = 16, 32  # BH is tl.dot's smallest M
# float32 latents take half the key rows per tile: at 32 the tile spills to the stack on sm_90 and sm_100 at K3's Lr 512
# (benchmarks/gpu/compile_check.py, benchmarks/results/gpu_compile.md)
BLOCK_S_FP32 = 16


@triton.jit
def _latent_decode_kernel(
    q_ptr, pool_ptr, table_ptr, lens_ptr, u_ptr,
    H, LR, DR, PS, stride_qn, stride_qh, stride_pp, stride_ps, stride_tn, stride_un, stride_uh,
    BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < H
    lc = tl.arange(0, BLOCK_L)
    rc = tl.arange(0, BLOCK_R)
    q_rows = q_ptr + seq * stride_qn + h[:, None] * stride_qh
    q_c = tl.load(q_rows + lc[None, :], mask=h_mask[:, None] & (lc[None, :] < LR), other=0.0).to(DOT_DTYPE)
    q_pe = tl.load(q_rows + LR + rc[None, :], mask=h_mask[:, None] & (rc[None, :] < DR), other=0.0).to(DOT_DTYPE)
    kv_len = tl.load(lens_ptr + seq)
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_L), dtype=tl.float32)
    for s0 in range(0, kv_len, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_mask = s < kv_len
        page = tl.load(table_ptr + seq * stride_tn + s // PS, mask=s_mask, other=0).to(tl.int64)
        rows = pool_ptr + page[:, None] * stride_pp + (s % PS)[:, None] * stride_ps
        c = tl.load(rows + lc[None, :], mask=s_mask[:, None] & (lc[None, :] < LR), other=0.0).to(DOT_DTYPE)
        pe = tl.load(rows + LR + rc[None, :], mask=s_mask[:, None] & (rc[None, :] < DR), other=0.0).to(DOT_DTYPE)
        scores = tl.dot(q_c, tl.trans(c), input_precision=PRECISION) + tl.dot(q_pe, tl.trans(pe), input_precision=PRECISION)
        scores = tl.where(s_mask[None, :], scores, float("-inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, scores, c, DOT_DTYPE, PRECISION)
    u = u_ptr + seq * stride_un + h[:, None] * stride_uh + lc[None, :]
    tl.store(u, acc / l_i[:, None], mask=h_mask[:, None] & (lc[None, :] < LR))


def latent_attention_paged(q_NHR: torch.Tensor, latent_pool: torch.Tensor, page_table_NP: torch.Tensor, kv_lens_N: torch.Tensor, lr: int) -> torch.Tensor:
    """ops/mla/decode_cpu.latent_attention_torch's u [N, H, Lr] (fp32): q_NHR the scaled absorbed query [N, H, R] in fp32,
    latent_pool [NP, PS, R] in its cache dtype (bf16 products on the GPU, fp32 accumulation), page_table [N, P].

    kv_lens[n] must lie in 1..P * PS and the pages those rows cover in 0..NP - 1 (entries past a length may hold anything);
    both are checked on the device (an asynchronous assertion, no host sync)."""
    n, h, r = q_NHR.shape
    pool_ok = latent_pool.dim() == 3 and latent_pool.shape[2] == r and 1 <= lr < r
    if not pool_ok or page_table_NP.dim() != 2 or page_table_NP.shape[0] != n or kv_lens_N.shape != (n,):
        raise ValueError(
            f"mla decode (triton): q {tuple(q_NHR.shape)}, latent pool {tuple(latent_pool.shape)}, page table {tuple(page_table_NP.shape)}, "
            f"kv_lens {tuple(kv_lens_N.shape)}, lr {lr}: expected [N, H, R], [pages, PS, R], [N, P], [N] and 1 <= lr < R"
        )
    if latent_pool.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"mla decode (triton): latent pool dtype {latent_pool.dtype}, expected float32, bfloat16 or float16")
    require_launchable("mla decode (triton)", q_NHR, latent_pool, page_table_NP, kv_lens_N)
    num_pages, page_size = latent_pool.shape[:2]
    u = torch.empty(n, h, lr, dtype=torch.float32, device=q_NHR.device)
    if n == 0:
        return u
    width = page_table_NP.shape[1]
    covered_NP = torch.arange(width, device=page_table_NP.device)[None, :] * page_size < kv_lens_N[:, None]
    pages_ok = ((page_table_NP >= 0) & (page_table_NP < num_pages)) | ~covered_NP
    lens_ok = (kv_lens_N >= 1) & (kv_lens_N <= width * page_size)
    torch._assert_async(pages_ok.all() & lens_ok.all(), f"mla decode (triton): kv_lens must lie in 1..{width * page_size}, their pages in 0..{num_pages - 1}")
    q_NHR = q_NHR.float().contiguous()
    latent_pool = latent_pool if latent_pool.stride(2) == 1 else latent_pool.contiguous()
    table = page_table_NP.to(torch.int32)
    lens = kv_lens_N.to(torch.int32)
    exact = latent_pool.dtype == torch.float32 or interpreting()  # the interpreter's tl.dot misreads 16-bit floats (moe_mxfp4.dot_dtype)
    dot_dtype = tl.float32 if exact else (tl.bfloat16 if latent_pool.dtype == torch.bfloat16 else tl.float16)
    grid = (n, triton.cdiv(h, BLOCK_H))
    _latent_decode_kernel[grid](
        q_NHR, latent_pool, table, lens, u,
        h, lr, r - lr, page_size, q_NHR.stride(0), q_NHR.stride(1), latent_pool.stride(0), latent_pool.stride(1),
        table.stride(0), u.stride(0), u.stride(1),
        BLOCK_H=BLOCK_H, BLOCK_S=BLOCK_S_FP32 if latent_pool.dtype == torch.float32 else BLOCK_S,
        BLOCK_L=triton.next_power_of_2(lr), BLOCK_R=max(16, triton.next_power_of_2(r - lr)),
        DOT_DTYPE=dot_dtype, PRECISION="ieee" if exact else "tf32",
    )  # fmt: skip
    return u
