"""MLA prefill over key blocks with an online softmax: the expanded form's numbers without its whole-context K/V.

Legend as in naive.py, plus BS keys per block. The expanded reference forms k_nope and v for every one of the s keys
([s, H, Dn + Dv]) and a [H, t, s] score matrix: at a long context that is the step's memory. Here each block of BS
cached latents is expanded on its own, its scores taken against all t queries, and folded into a running max / sum /
weighted value per (head, query) (the flash-attention recurrence), so the peak is O(BS x H x (Dn + Dv) + H x t x BS),
independent of s. Only the blocks that reach past q_offset need the causal mask; the others are seen by every query.
"""

from __future__ import annotations

import torch

from openk3.ops import thresholds
from openk3.ops.mla.naive import causal_mask
from openk3.ops.mla.sdpa import mla_expanded_sdpa

BLOCK_KEYS = 1024


def mla_blockwise(
    q_nope_tHD: torch.Tensor,
    q_pe_tHR: torch.Tensor,
    c_kv_sL: torch.Tensor,
    k_pe_sR: torch.Tensor,
    w_uk_HDL: torch.Tensor,
    w_uv_HDL: torch.Tensor,
    scale: float,
    q_offset: int,
    block_keys: int = BLOCK_KEYS,
) -> torch.Tensor:
    """Same contract as `mla_expanded` (one sequence, causal with q_offset, fp32 math). Returns [t, H, Dv]."""
    if block_keys < 1:
        raise ValueError(f"mla blockwise: block_keys {block_keys}, expected >= 1")
    t, s = q_nope_tHD.shape[0], c_kv_sL.shape[0]
    h, dv = w_uv_HDL.shape[0], w_uv_HDL.shape[1]
    q_nope_HtD = q_nope_tHD.float().transpose(0, 1) * scale
    q_pe_HtR = q_pe_tHR.float().transpose(0, 1) * scale
    w_uk, w_uv = w_uk_HDL.float(), w_uv_HDL.float()
    device = q_nope_tHD.device
    m_Ht = torch.full((h, t), float("-inf"), device=device)
    l_Ht = torch.zeros(h, t, device=device)
    acc_HtD = torch.zeros(h, t, dv, device=device)
    for b0 in range(0, s, block_keys):
        b1 = min(b0 + block_keys, s)
        c = c_kv_sL[b0:b1].float()
        k_nope_HbD = torch.einsum("bl,hdl->hbd", c, w_uk)
        v_HbD = torch.einsum("bl,hdl->hbd", c, w_uv)
        scores_Htb = torch.matmul(q_nope_HtD, k_nope_HbD.transpose(1, 2)) + torch.matmul(q_pe_HtR, k_pe_sR[b0:b1].float().T)
        if b1 - 1 > q_offset:  # some key of this block is later than the first query
            visible_tb = causal_mask(t, b1, q_offset, device)[:, b0:]
            scores_Htb = scores_Htb.masked_fill(~visible_tb, float("-inf"))
        # every query sees key 0, so after the first block each running max is finite (and exp(-inf - m) = 0 before it)
        m_new = torch.maximum(m_Ht, scores_Htb.amax(dim=-1))
        alpha = torch.exp(m_Ht - m_new)
        p_Htb = torch.exp(scores_Htb - m_new.unsqueeze(-1))
        l_Ht = l_Ht * alpha + p_Htb.sum(dim=-1)
        acc_HtD = acc_HtD * alpha.unsqueeze(-1) + torch.matmul(p_Htb, v_HbD)
        m_Ht = m_new
    return (acc_HtD / l_Ht.unsqueeze(-1)).transpose(0, 1).to(q_nope_tHD.dtype)


def mla_expanded_or_blockwise(
    q_nope_tHD: torch.Tensor,
    q_pe_tHR: torch.Tensor,
    c_kv_sL: torch.Tensor,
    k_pe_sR: torch.Tensor,
    w_uk_HDL: torch.Tensor,
    w_uv_HDL: torch.Tensor,
    scale: float,
    q_offset: int,
) -> torch.Tensor:
    """The registry's "sized" "mla_prefill": torch's SDPA over expanded K/V (sdpa.py) while the expanded K/V and the
    chunk x context mask stay under thresholds.MLA_EXPANDED_MAX_BYTES, key blocks above (a memory bound, not a speed switch)."""
    t, s = q_nope_tHD.shape[0], c_kv_sL.shape[0]
    h, dn = q_nope_tHD.shape[1], q_nope_tHD.shape[2]
    width = h * (dn + q_pe_tHR.shape[2] + w_uv_HDL.shape[1])
    if s * width * q_nope_tHD.element_size() + t * s <= thresholds.MLA_EXPANDED_MAX_BYTES:
        return mla_expanded_sdpa(q_nope_tHD, q_pe_tHR, c_kv_sL, k_pe_sR, w_uk_HDL, w_uv_HDL, scale, q_offset)
    return mla_blockwise(q_nope_tHD, q_pe_tHR, c_kv_sL, k_pe_sR, w_uk_HDL, w_uv_HDL, scale, q_offset).to(q_nope_tHD.dtype)
