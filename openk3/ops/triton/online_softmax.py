"""The online softmax's step over one key tile, shared by the latent-attention kernels (mla_decode.py, mla_prefill.py):
fold a tile's scores [M, BS] into the running max m [M], sum l [M] and weighted values acc [M, W] (the flash-attention
recurrence), the values of the tile being `values` [BS, W]. Masked scores are -inf; every row must have seen one finite
score by its first tile (key 0 is visible to every query), so m is finite after it and exp(-inf - m) = 0."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(m_i, l_i, acc, scores, values, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), values, input_precision=PRECISION)
    return m_new, l_i, acc
