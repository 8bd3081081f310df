"""MLA prefill fast path: expand K/V from the latent and call torch's fused scaled-dot-product attention.

Legend as in naive.py. Same contract as `mla_expanded`; the work is in the compute dtype rather than fp32, which is why
tests compare it against the reference with a tolerance.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.ops.mla.naive import causal_mask


def mla_expanded_sdpa(
    q_nope_tHD: torch.Tensor,
    q_pe_tHR: torch.Tensor,
    c_kv_sL: torch.Tensor,
    k_pe_sR: torch.Tensor,
    w_uk_HDL: torch.Tensor,
    w_uv_HDL: torch.Tensor,
    scale: float,
    q_offset: int,
) -> torch.Tensor:
    t, s = q_nope_tHD.shape[0], c_kv_sL.shape[0]
    h = q_nope_tHD.shape[1]
    dtype = q_nope_tHD.dtype
    c = c_kv_sL.to(dtype)
    k_nope_HsD = torch.einsum("sl,hdl->hsd", c, w_uk_HDL.to(dtype))
    v_HsD = torch.einsum("sl,hdl->hsd", c, w_uv_HDL.to(dtype))
    k_HsD = torch.cat([k_nope_HsD, k_pe_sR.to(dtype)[None].expand(h, s, -1)], dim=-1)
    q_HtD = torch.cat([q_nope_tHD, q_pe_tHR.to(dtype)], dim=-1).transpose(0, 1)
    if q_offset == 0 and t == s:
        out = F.scaled_dot_product_attention(q_HtD, k_HsD, v_HsD, is_causal=True, scale=scale)
    else:
        out = F.scaled_dot_product_attention(q_HtD, k_HsD, v_HsD, attn_mask=causal_mask(t, s, q_offset, q_HtD.device), scale=scale)
    return out.transpose(0, 1)
