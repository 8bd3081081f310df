"""MLA attention over a part of each sequence's keys, with the log-sum-exp of its scores, and the exact merge of such
parts: what decode context parallelism runs (parallel/cp/sharded_mla.py), each rank over the latents it holds -- a decode
step's queries over the pages (`mla_decode_paged_lse`), a prefill chunk's queries over given rows (`mla_rows_lse`).

Legend: W parts (ranks), N sequences, H heads, Dn/Dr/Dv qk_nope/qk_rope/v head dims, Lr kv_lora_rank, R = Lr + Dr, NP pages,
PS rows per page, P page-table width, S = P * PS gathered rows.

A part over keys K_w gives out_w = sum_{k in K_w} e^{s_k} v_k / Z_w and lse_w = log Z_w (Z_w = sum_{k in K_w} e^{s_k}).
Over the union, out = sum_w (Z_w / Z) out_w with Z = sum_w Z_w, i.e. weights exp(lse_w - log Z): `merge_by_lse` is that
formula, the definition (tested against one softmax over the concatenated keys). An empty part (no key: Z_w = 0) has
lse_w = -inf and weight 0, whatever its out_w; a sequence no part has a key for is refused (its softmax is undefined).
"""

from __future__ import annotations

import torch

from openk3.ops.mla.absorbed import absorbed_query, values_of
from openk3.ops.mla.decode_cpu import masked_latent_scores


def merge_by_lse(out_WNHV: torch.Tensor, lse_WNH: torch.Tensor) -> torch.Tensor:
    """The attention over the union of the parts' keys, [N, H, Dv] (fp32), from each part's output and log-sum-exp."""
    if out_WNHV.shape[:-1] != lse_WNH.shape:
        raise ValueError(f"merge_by_lse: outputs {tuple(out_WNHV.shape)} and log-sum-exps {tuple(lse_WNH.shape)} differ in [W, N, H]")
    lse = lse_WNH.float()
    top_NH = lse.max(dim=0).values
    if bool(torch.isneginf(top_NH).any()):
        raise ValueError("merge_by_lse: a (sequence, head) has no key in any part (every log-sum-exp is -inf)")
    weight_WNH = torch.exp(lse - top_NH)  # exp(-inf) = 0: an empty part drops out
    total_NH = weight_WNH.sum(dim=0)
    return (weight_WNH[..., None] * out_WNHV.float()).sum(dim=0) / total_NH[..., None]


def latent_attention_lse(
    q_NHR: torch.Tensor, latent_pool: torch.Tensor, page_table_NP: torch.Tensor, kv_lens_N: torch.Tensor, lr: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(u [N, H, Lr], lse [N, H]): ops/mla/decode_cpu.py's latent attention over each sequence's first kv_lens[n] rows,
    with the log-sum-exp of its (scaled) scores; kv_lens[n] = 0 gives u = 0 and lse = -inf (an empty part)."""
    n, num_pages = page_table_NP.shape
    if n == 0 or num_pages == 0:
        return q_NHR.new_zeros(n, q_NHR.shape[1], lr, dtype=torch.float32), q_NHR.new_full((n, q_NHR.shape[1]), float("-inf"), dtype=torch.float32)
    scores_NHS, rows_NSR = masked_latent_scores(q_NHR.float(), latent_pool, page_table_NP, kv_lens_N)
    lse_NH = torch.logsumexp(scores_NHS, dim=-1)
    # exp(score - lse) is the softmax where the part has keys; an empty part's row is all -inf - -inf = NaN: zeroed
    p_NHS = torch.exp(scores_NHS - lse_NH[..., None]).nan_to_num_(0.0)
    return torch.matmul(p_NHS, rows_NSR)[..., :lr], lse_NH


def mla_decode_paged_lse(
    q_nope_NHD: torch.Tensor,
    q_pe_NHR: torch.Tensor,
    latent_pool: torch.Tensor,
    page_table_NP: torch.Tensor,
    kv_lens_N: torch.Tensor,
    w_uk_HDL: torch.Tensor,
    w_uv_HDL: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ops/mla/absorbed.py's `mla_decode_paged` over the rows a part holds, returning (out [N, H, Dv] fp32, lse [N, H]):
    kv_lens[n] may be 0 (this part holds none of sequence n's keys). W_UV is applied here, before any merge: it is
    linear, so merging outputs equals merging the latent sums, and Dv values per head travel instead of Lr."""
    q_NHR = absorbed_query(q_nope_NHD, q_pe_NHR, w_uk_HDL, scale)
    u_NHL, lse_NH = latent_attention_lse(q_NHR, latent_pool, page_table_NP, kv_lens_N, w_uk_HDL.shape[-1])
    return values_of(u_NHL, w_uv_HDL), lse_NH


ROWS_LSE_SCORE_ELEMENTS = 2**22  # scores held at once by mla_rows_lse (16 MiB fp32): key blocks of this over t x H rows


def mla_rows_lse(
    q_nope_tHD: torch.Tensor,
    q_pe_tHR: torch.Tensor,
    rows_sR: torch.Tensor,
    w_uk_HDL: torch.Tensor,
    w_uv_HDL: torch.Tensor,
    scale: float,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [t, H, Dv] fp32, lse [t, H]) of t queries of one sequence over the latent rows [s, R] ([c | k_pe] as the pages
    hold them): every query over every row, or with `causal` (s == t: the chunk's own rows) query j over rows 0 .. j. In the
    latent space (the absorbed query), key blocks with an online softmax, so its memory is the rows plus
    ROWS_LSE_SCORE_ELEMENTS scores, whatever s is; no rows (s = 0) is an empty part (zeros, -inf)."""
    t, h = q_nope_tHD.shape[:2]
    s, lr = rows_sR.shape[0], w_uk_HDL.shape[-1]
    if causal and s != t:
        raise ValueError(f"mla_rows_lse: causal attention over {s} rows for {t} queries; expected the chunk's own {t} rows")
    q_MR = absorbed_query(q_nope_tHD, q_pe_tHR, w_uk_HDL, scale).reshape(t * h, -1)  # row m = (query m // H, head m % H)
    top_M = q_MR.new_full((t * h,), float("-inf"))
    total_M = q_MR.new_zeros(t * h)
    acc_ML = q_MR.new_zeros(t * h, lr)
    query_M = torch.arange(t, device=q_MR.device).repeat_interleave(h)
    block = max(1, ROWS_LSE_SCORE_ELEMENTS // max(1, t * h))
    for lo in range(0, t if causal else s, block):  # causal: no query sees a row past the last query
        keys_bR = rows_sR[lo : lo + block].float()
        scores_Mb = q_MR @ keys_bR.T
        if causal:
            key_b = torch.arange(lo, lo + keys_bR.shape[0], device=q_MR.device)
            scores_Mb.masked_fill_(key_b[None, :] > query_M[:, None], float("-inf"))
        new_top = torch.maximum(top_M, scores_Mb.max(dim=-1).values)
        # a row with no visible key yet keeps top -inf: exp(-inf - -inf) would be NaN, and its sums are still 0
        finite = torch.isfinite(new_top)
        rescale = torch.where(finite, torch.exp(top_M - new_top), 0.0)
        p_Mb = torch.exp(scores_Mb - torch.where(finite, new_top, 0.0)[:, None])
        total_M = total_M * rescale + p_Mb.sum(dim=-1)
        acc_ML = acc_ML * rescale[:, None] + p_Mb @ keys_bR[:, :lr]
        top_M = new_top
    lse_M = torch.where(total_M > 0, top_M + torch.log(total_M), float("-inf"))
    u_tHL = (acc_ML / total_M.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).view(t, h, lr)
    return values_of(u_tHL, w_uv_HDL), lse_M.view(t, h)
