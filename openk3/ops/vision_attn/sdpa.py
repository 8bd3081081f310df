"""Vision attention by torch's scaled_dot_product_attention, one call per image (no L x L mask is built); the same
contract as naive.py."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from openk3.ops.vision_attn.naive import check_lengths


def vision_attention_sdpa(q_LHK: torch.Tensor, k_LHK: torch.Tensor, v_LHK: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """Returns [L, H, K] in q's dtype."""
    check_lengths(q_LHK, lengths)
    out = []
    for q, k, v in zip(*(x.split(list(lengths)) for x in (q_LHK, k_LHK, v_LHK)), strict=True):
        out.append(F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1))
    return torch.cat(out)
