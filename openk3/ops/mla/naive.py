"""MLA attention over the compressed latent, the reference (expanded K/V) form. NoPE: no rotation anywhere.

Legend (one sequence): t new query tokens, s key tokens (cached + new), H heads, Dn qk_nope_head_dim, Dr qk_rope_head_dim,
Dv v_head_dim, Lr kv_lora_rank. W_UK [H, Dn, Lr] and W_UV [H, Dv, Lr] are the two halves of kv_b_proj.
Query j sits at absolute position q_offset + j and sees keys 0 .. q_offset + j (causal).
"""

from __future__ import annotations

import torch


def split_kv_b(kv_b_weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj.weight [H * (Dn + Dv), Lr] (per head rows [k_nope; v]) -> W_UK [H, Dn, Lr], W_UV [H, Dv, Lr] (views)."""
    w = kv_b_weight.view(num_heads, qk_nope_head_dim + v_head_dim, -1)
    return w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]


def causal_mask(t: int, s: int, q_offset: int, device: torch.device) -> torch.Tensor:
    """[t, s] bool, True where query j may attend key i (i <= q_offset + j)."""
    q_pos = torch.arange(t, device=device)[:, None] + q_offset
    return torch.arange(s, device=device)[None, :] <= q_pos


def mla_expanded(
    q_nope_tHD: torch.Tensor,
    q_pe_tHR: torch.Tensor,
    c_kv_sL: torch.Tensor,
    k_pe_sR: torch.Tensor,
    w_uk_HDL: torch.Tensor,
    w_uv_HDL: torch.Tensor,
    scale: float,
    q_offset: int,
) -> torch.Tensor:
    """Expand per-head keys and values from the latent, then plain causal softmax attention. Returns [t, H, Dv] (fp32 math)."""
    t, s = q_nope_tHD.shape[0], c_kv_sL.shape[0]
    c = c_kv_sL.float()
    k_nope_sHD = torch.einsum("sl,hdl->shd", c, w_uk_HDL.float())
    v_sHD = torch.einsum("sl,hdl->shd", c, w_uv_HDL.float())
    scores_Hts = torch.einsum("thd,shd->hts", q_nope_tHD.float(), k_nope_sHD)
    scores_Hts = scores_Hts + torch.einsum("thr,sr->hts", q_pe_tHR.float(), k_pe_sR.float())
    scores_Hts = scores_Hts * scale
    scores_Hts = scores_Hts.masked_fill(~causal_mask(t, s, q_offset, scores_Hts.device), float("-inf"))
    p_Hts = torch.softmax(scores_Hts, dim=-1)
    return torch.einsum("hts,shd->thd", p_Hts, v_sHD).to(q_nope_tHD.dtype)
