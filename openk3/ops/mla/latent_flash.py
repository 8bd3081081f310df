"""MLA prefill in the latent space through torch's CPU flash attention: no per-head K/V, no chunk x context scores.

Legend as in naive.py, plus R = Lr + Dr (a cached latent row [c | k_pe]) and off = q_offset (the cached keys before the
chunk). In the absorbed form (absorbed.py) every head attends the same rows [c | k_pe] with the query [W_UK^T q_nope | q_pe]
and takes values c from those rows: multi-query attention with one key/value "head" of width R. So the keys and values
are the latents themselves (the cache's own bytes, read once), and the work splits in two flash calls:
- the cached prefix, keys 0 .. off - 1, is seen by every query of the chunk: the H heads fold into H x t query rows of a
  single head, with no mask (in key blocks of PREFIX_KEYS_PER_CALL: the kernel packs a half-precision call's keys whole);
- the chunk's own keys off .. off + t - 1 are the usual causal triangle (t x t per head).
torch's CPU flash kernel tiles both (its working memory is per thread and fixed) and returns each row's log-sum-exp, and
the two partial softmaxes merge exactly by it. The values are the whole rows (the kernel wants one head size for Q, K and
V); the k_pe columns of the result are dropped before W_UV, as the decode form does (decode_cpu.py).
Memory: the rows [s, R] (one layer's cache for this sequence) plus O(H x t x R); nothing of size s x H or t x s.
"""

from __future__ import annotations

import torch

from openk3.ops.cpu import require_cpu_inference

# torch's CPU flash attention with its log-sum-exp, the kernel F.scaled_dot_product_attention runs on CPU (public since
# torch 2.3 as an aten op; the public function drops the log-sum-exp that merging two key ranges needs)
_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
# The cached prefix's keys per flash call. torch's CPU kernel packs the K and V of a bf16/fp16 call whole (for its AMX
# tiles: 392 MB more for 1M rows of R = 96 in bf16; an fp32 call takes 8 MB), so the prefix goes in key blocks whose
# partial softmaxes merge by their log-sum-exps like the two ranges: ~24 MB packed per call in bf16 at 64k keys.
PREFIX_KEYS_PER_CALL = 1 << 16


def latent_rows(c_kv_sL: torch.Tensor, k_pe_sR: torch.Tensor) -> torch.Tensor:
    """[c | k_pe] as rows [s, R]: the buffer itself where the two are the column halves of one row-major [s, R] tensor (the
    model splits the latents it read back from the pages that way), else a copy. At 1M tokens a copy is 384 MB per layer
    call on the demo model."""
    s, lr = c_kv_sL.shape
    width = lr + k_pe_sR.shape[1]
    one_buffer = (
        c_kv_sL.dtype == k_pe_sR.dtype
        and c_kv_sL.stride() == k_pe_sR.stride() == (width, 1)
        and k_pe_sR.data_ptr() == c_kv_sL.data_ptr() + lr * c_kv_sL.element_size()
    )
    return c_kv_sL.as_strided((s, width), (width, 1)) if one_buffer and s > 0 else torch.cat((c_kv_sL, k_pe_sR), dim=-1)


def mla_latent_flash(
    q_nope_tHD: torch.Tensor,
    q_pe_tHR: torch.Tensor,
    c_kv_sL: torch.Tensor,
    k_pe_sR: torch.Tensor,
    w_uk_HDL: torch.Tensor,
    w_uv_HDL: torch.Tensor,
    scale: float,
    q_offset: int,
) -> torch.Tensor:
    """Same contract as `mla_expanded` for a prefill chunk (keys = the q_offset cached tokens + the chunk's t: s = q_offset + t),
    for CPU inference in fp32 (the "cpu" backend), bf16 or fp16 ("cpu_half": the kernel accumulates in fp32 and its
    log-sum-exp is fp32, so the two key ranges merge in fp32 before the result returns to the model's dtype). Returns [t, H, Dv]."""
    # the cache may be narrower than the model (fp8 pages): its rows are read in the model's dtype
    require_cpu_inference("mla latent flash", (torch.float32, torch.bfloat16, torch.float16), q_nope_tHD, q_pe_tHR, w_uk_HDL, w_uv_HDL)
    t, h = q_nope_tHD.shape[:2]
    s, lr = c_kv_sL.shape
    if s != q_offset + t:
        raise ValueError(f"mla latent flash: {s} keys for {t} queries at offset {q_offset}; expected keys = offset + queries")
    dtype = q_nope_tHD.dtype
    q_lat_HtL = torch.matmul(q_nope_tHD.transpose(0, 1), w_uk_HDL.to(dtype))
    q_HtR = torch.cat((q_lat_HtL, q_pe_tHR.transpose(0, 1).to(dtype)), dim=-1)
    rows_sR = latent_rows(c_kv_sL, k_pe_sR).to(dtype)
    own_HtR = rows_sR[q_offset:].expand(h, t, -1)  # the chunk's rows for every head: a view
    u_HtR, lse_Ht = _flash_cpu(q_HtR[None], own_HtR[None], own_HtR[None], is_causal=True, scale=scale)
    u_HtR, lse_Ht = u_HtR[0], lse_Ht[0]
    if q_offset > 0:
        q_fold = q_HtR.reshape(1, 1, h * t, -1)
        u_all, lse_all = u_HtR.float(), lse_Ht  # merged in fp32: the weights are the fp32 log-sum-exps
        for lo in range(0, q_offset, PREFIX_KEYS_PER_CALL):
            keys = rows_sR[None, None, lo : min(lo + PREFIX_KEYS_PER_CALL, q_offset)]
            u_part, lse_part = _flash_cpu(q_fold, keys, keys, scale=scale)
            lse_part = lse_part.view(h, t)
            lse_new = torch.logaddexp(lse_all, lse_part)
            u_all = u_all * torch.exp(lse_all - lse_new)[..., None] + u_part.view(h, t, -1) * torch.exp(lse_part - lse_new)[..., None]
            lse_all = lse_new
        u_HtR = u_all.to(dtype)
    out_HtD = torch.matmul(u_HtR[..., :lr], w_uv_HDL.to(dtype).transpose(1, 2))
    return out_HtD.transpose(0, 1)
