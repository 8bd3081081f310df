"""Vision attention, the definition: every patch of an image (or of a video chunk, all its frames) attends to every patch
of the same image and to nothing else; no mask within it, no causality.

Legend: L patches of all images packed in order, H heads, K head size; `lengths` the patch count of each image (sum = L).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_lengths(q_LHK: torch.Tensor, lengths: Sequence[int]) -> None:
    if sum(lengths) != q_LHK.shape[0] or any(n < 1 for n in lengths):
        raise ValueError(f"vision attention: image lengths {list(lengths)} must be positive and sum to the {q_LHK.shape[0]} packed patches")


def vision_attention_naive(q_LHK: torch.Tensor, k_LHK: torch.Tensor, v_LHK: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """softmax(q k^T / sqrt(K)) v within each image, in fp32. Returns [L, H, K] in q's dtype."""
    check_lengths(q_LHK, lengths)
    scale = q_LHK.shape[-1] ** -0.5
    out, start = [], 0
    for n in lengths:
        q, k, v = (x[start : start + n].float() for x in (q_LHK, k_LHK, v_LHK))
        scores_Hnn = torch.einsum("qhk,shk->hqs", q, k) * scale
        out.append(torch.einsum("hqs,shk->qhk", torch.softmax(scores_Hnn, dim=-1), v))
        start += n
    return torch.cat(out).to(q_LHK.dtype)
