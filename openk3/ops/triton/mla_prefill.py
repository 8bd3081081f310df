"""MLA prefill in the absorbed latent space, as a Triton kernel: ops/mla/absorbed.py's mla_absorbed (the registry's
"mla_prefill"/"absorbed") with the causal latent attention done tile by tile (the registry's "mla_prefill"/"triton" on
cuda).

Legend as in ops/mla/naive.py: t queries (the chunk), s keys (the context so far, the chunk included), H heads, Dn / Dr
the no-position / rotary query widths, Lr kv_lora_rank, R = Lr + Dr the latent row width, Dv the value width; BT queries
and BS keys per tile.

Per-head K and V are never formed, and no [t, s] score matrix exists: the query is absorbed into the latent space
(q~ = q_nope . W_uk, [t, H, Lr]) and joined with q_pe, so a query scores a cached row [c | k_pe] in one product; one
program takes BT queries of one head and walks the key tiles up to the last key its queries may see (key j is seen by
query i when j <= q_offset + i), with the online softmax's running max and sum, accumulating u = softmax . c [BT, Lr];
the output is u . W_uv^T. Peak memory is the latent rows themselves (the cache's, [s, R]) and one tile per program: at
a long context the chunk's K/V for the whole context (mla_expanded's O(s x H x (Dn + Dv))) is what this avoids. The
price is FLOPs: a score costs R (576 in K3) multiply-adds here against Dn + Dr (192) in the expanded form, the trade
FlashMLA-style kernels make for decode; whether it wins for prefill chunks on a GPU is for benchmarks/gpu/run.sh to say.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openk3.ops.triton import interpreting, require_launchable
from openk3.ops.triton.online_softmax import online_softmax_step

BLOCK_T, BLOCK_S = 16, 32  # BT is tl.dot's smallest M
BLOCK_S_FP32 = 16  # float32 latents: at 32 key rows the tile spills on sm_90 and sm_100 (as ops/triton/mla_decode.py)


@triton.jit
def _latent_prefill_kernel(
    q_ptr, kv_ptr, u_ptr,
    T, S, LR, DR, q_offset, stride_qt, stride_qh, stride_ks, stride_ut, stride_uh,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1).to(tl.int64)
    i_mask = i < T
    lc = tl.arange(0, BLOCK_L)
    rc = tl.arange(0, BLOCK_R)
    q_rows = q_ptr + i[:, None].to(tl.int64) * stride_qt + h * stride_qh
    q_c = tl.load(q_rows + lc[None, :], mask=i_mask[:, None] & (lc[None, :] < LR), other=0.0).to(DOT_DTYPE)
    q_pe = tl.load(q_rows + LR + rc[None, :], mask=i_mask[:, None] & (rc[None, :] < DR), other=0.0).to(DOT_DTYPE)
    m_i = tl.full((BLOCK_T,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_T,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_T, BLOCK_L), dtype=tl.float32)
    last_query = tl.minimum(tl.program_id(0) * BLOCK_T + BLOCK_T, T) - 1
    kv_end = tl.minimum(S, q_offset + last_query + 1)  # keys past the tile's last query's position are seen by none of it
    for s0 in range(0, kv_end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_mask = s < kv_end
        rows = kv_ptr + s[:, None].to(tl.int64) * stride_ks
        c = tl.load(rows + lc[None, :], mask=s_mask[:, None] & (lc[None, :] < LR), other=0.0).to(DOT_DTYPE)
        pe = tl.load(rows + LR + rc[None, :], mask=s_mask[:, None] & (rc[None, :] < DR), other=0.0).to(DOT_DTYPE)
        scores = tl.dot(q_c, tl.trans(c), input_precision=PRECISION) + tl.dot(q_pe, tl.trans(pe), input_precision=PRECISION)
        visible = s_mask[None, :] & (s[None, :] <= q_offset + i[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, scores, c, DOT_DTYPE, PRECISION)
    u = u_ptr + i[:, None].to(tl.int64) * stride_ut + h * stride_uh + lc[None, :]
    tl.store(u, acc / l_i[:, None], mask=i_mask[:, None] & (lc[None, :] < LR))


def mla_prefill_latent(
    q_nope_tHD: torch.Tensor,
    q_pe_tHR: torch.Tensor,
    c_kv_sL: torch.Tensor,
    k_pe_sR: torch.Tensor,
    w_uk_HDL: torch.Tensor,
    w_uv_HDL: torch.Tensor,
    scale: float,
    q_offset: int,
) -> torch.Tensor:
    """The `mla_prefill` contract (one sequence, query i at position q_offset + i, causal; fp32 math, bf16/fp16 products
    on the GPU for 16-bit latents): [t, H, Dv] in q_nope's dtype. Needs s >= q_offset + t (every query's keys cached)."""
    t, h, dn = q_nope_tHD.shape
    s, lr = c_kv_sL.shape
    dr = k_pe_sR.shape[-1]
    shapes_ok = q_pe_tHR.shape == (t, h, dr) and k_pe_sR.shape == (s, dr) and w_uk_HDL.shape == (h, dn, lr)
    shapes_ok = shapes_ok and w_uv_HDL.dim() == 3 and w_uv_HDL.shape[0] == h and w_uv_HDL.shape[2] == lr
    if not shapes_ok:
        raise ValueError(
            f"mla prefill (triton): q_nope {tuple(q_nope_tHD.shape)}, q_pe {tuple(q_pe_tHR.shape)}, c_kv {tuple(c_kv_sL.shape)}, "
            f"k_pe {tuple(k_pe_sR.shape)}, w_uk {tuple(w_uk_HDL.shape)}, w_uv {tuple(w_uv_HDL.shape)}: expected [t, H, Dn], [t, H, Dr], "
            "[s, Lr], [s, Dr], [H, Dn, Lr], [H, Dv, Lr]"
        )
    if q_offset < 0 or s < q_offset + t:
        raise ValueError(f"mla prefill (triton): q_offset {q_offset} with {t} queries needs {q_offset + t} cached keys, got {s}")
    require_launchable("mla prefill (triton)", q_nope_tHD, q_pe_tHR, c_kv_sL, k_pe_sR, w_uk_HDL, w_uv_HDL)
    dv = w_uv_HDL.shape[1]
    out = torch.empty(t, h, dv, dtype=q_nope_tHD.dtype, device=q_nope_tHD.device)
    if t == 0:
        return out
    # the absorbed, scaled query [q~ | q_pe] and the latent rows [c | k_pe]: a score is one R-wide product (as in decode)
    q_lat_HtL = torch.matmul(q_nope_tHD.float().transpose(0, 1), w_uk_HDL.float())
    q_tHR = torch.cat((q_lat_HtL.transpose(0, 1), q_pe_tHR.float()), dim=-1).mul_(scale).contiguous()
    kv_dtype = c_kv_sL.dtype if c_kv_sL.dtype in (torch.bfloat16, torch.float16) else torch.float32
    kv_sR = torch.cat((c_kv_sL.to(kv_dtype), k_pe_sR.to(kv_dtype)), dim=-1).contiguous()
    u_tHL = torch.empty(t, h, lr, dtype=torch.float32, device=q_nope_tHD.device)
    exact = kv_dtype == torch.float32 or interpreting()  # the interpreter's tl.dot misreads 16-bit floats (moe_mxfp4.dot_dtype)
    dot_dtype = tl.float32 if exact else (tl.bfloat16 if kv_dtype == torch.bfloat16 else tl.float16)
    grid = (triton.cdiv(t, BLOCK_T), h)
    _latent_prefill_kernel[grid](
        q_tHR, kv_sR, u_tHL,
        t, s, lr, dr, q_offset, q_tHR.stride(0), q_tHR.stride(1), kv_sR.stride(0), u_tHL.stride(0), u_tHL.stride(1),
        BLOCK_T=BLOCK_T, BLOCK_S=BLOCK_S_FP32 if kv_dtype == torch.float32 else BLOCK_S,
        BLOCK_L=triton.next_power_of_2(lr), BLOCK_R=max(16, triton.next_power_of_2(dr)),
        DOT_DTYPE=dot_dtype, PRECISION="ieee" if exact else "tf32",
    )  # fmt: skip
    out.copy_(torch.matmul(u_tHL.transpose(0, 1), w_uv_HDL.float().transpose(1, 2)).transpose(0, 1))
    return out
