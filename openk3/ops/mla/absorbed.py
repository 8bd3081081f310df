"""MLA attention in absorbed form: attend directly over the cached latents (the decode fast path).

Legend: N sequences, H heads, Dn qk_nope_head_dim, Dr qk_rope_head_dim, Dv v_head_dim, Lr kv_lora_rank, R = Lr + Dr,
NP pages in the pool, PS tokens per page, P pages per sequence, S = P * PS gathered key slots.
W_UK is folded into the query (q~ = W_UK^T q_nope, in R^Lr) and W_UV applied after the weighted latent sum, so per step
the work is O(context x (Lr + Dr)) per head instead of expanding K/V for every cached token. W_UV cannot be folded into
W_o in K3 because the output gate sits between them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from openk3.ops.mla.decode_cpu import latent_attention_torch
from openk3.ops.mla.naive import causal_mask

LatentAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def mla_absorbed(
    q_nope_tHD: torch.Tensor,
    q_pe_tHR: torch.Tensor,
    c_kv_sL: torch.Tensor,
    k_pe_sR: torch.Tensor,
    w_uk_HDL: torch.Tensor,
    w_uv_HDL: torch.Tensor,
    scale: float,
    q_offset: int,
) -> torch.Tensor:
    """Same contract as `mla_expanded` (one sequence, causal with q_offset). Returns [t, H, Dv]."""
    t, s = q_nope_tHD.shape[0], c_kv_sL.shape[0]
    q_lat_tHL = torch.einsum("thd,hdl->thl", q_nope_tHD.float(), w_uk_HDL.float())
    c = c_kv_sL.float()
    scores_Hts = torch.einsum("thl,sl->hts", q_lat_tHL, c) + torch.einsum("thr,sr->hts", q_pe_tHR.float(), k_pe_sR.float())
    scores_Hts = (scores_Hts * scale).masked_fill(~causal_mask(t, s, q_offset, scores_Hts.device), float("-inf"))
    u_tHL = torch.einsum("hts,sl->thl", torch.softmax(scores_Hts, dim=-1), c)
    return torch.einsum("thl,hdl->thd", u_tHL, w_uv_HDL.float()).to(q_nope_tHD.dtype)


def mla_decode_paged(
    q_nope_NHD: torch.Tensor,
    q_pe_NHR: torch.Tensor,
    latent_pool: torch.Tensor,
    page_table_NP: torch.Tensor,
    kv_lens_N: torch.Tensor,
    w_uk_HDL: torch.Tensor,
    w_uv_HDL: torch.Tensor,
    scale: float,
    latent_attention: LatentAttention = latent_attention_torch,
) -> torch.Tensor:
    """One query token per sequence attending its first kv_lens[n] cached latents (the new token's latent included).

    latent_pool [NP, PS, R]; page_table [N, P] (entries past a sequence's length may hold any page id: masked out).
    Returns [N, H, Dv]. Every kv_lens[n] must lie in 1..P * PS; the C form raises ValueError for a length or page id out
    of range. `latent_attention`: the form of the attention over the latents (ops/mla/decode_cpu.py; the registry's
    "mla_decode" entries bind it).
    """
    u_NHL = latent_attention(absorbed_query(q_nope_NHD, q_pe_NHR, w_uk_HDL, scale), latent_pool, page_table_NP, kv_lens_N, w_uk_HDL.shape[-1])
    return values_of(u_NHL, w_uv_HDL).to(q_nope_NHD.dtype)


def absorbed_query(q_nope_NHD: torch.Tensor, q_pe_NHR: torch.Tensor, w_uk_HDL: torch.Tensor, scale: float) -> torch.Tensor:
    """[N, H, R] fp32: the decode query [W_UK^T q_nope | q_pe], scaled, so the scores against a cached [c | k_pe] row are
    one product. Plain matmuls over heads, not einsum: at decode sizes einsum's own permutes and reshapes cost as much as
    the products; scaled here: H x R values, not H x S."""
    q_lat_HNL = torch.matmul(q_nope_NHD.float().transpose(0, 1), w_uk_HDL.float())
    return torch.cat((q_lat_HNL.transpose(0, 1), q_pe_NHR.float()), dim=-1).mul_(scale)


def values_of(u_NHL: torch.Tensor, w_uv_HDL: torch.Tensor) -> torch.Tensor:
    """[N, H, Dv] fp32: W_UV applied to each head's weighted sum of latents."""
    return torch.matmul(u_NHL.transpose(0, 1), w_uv_HDL.float().transpose(1, 2)).transpose(0, 1)
