"""KDA over a mixed serving step: single-token sequences (decode continuations) take the decode recurrence, the others the
chunkwise prefill. The "mixed" form of "kda_prefill" (ops/registry.py), and its "auto" for inference.

Legend: T packed tokens, N sequences, H heads, K key dim, V value dim; tensors as in naive.kda_recurrent, packed (B = 1).

Why: a chunked prefill pads every sequence to whole chunks, so a step that packs one prompt chunk with thirty decode tokens
would pay thirty 64-row chunks for thirty rows of work. vLLM's hybrid models split such batches the same way (decode requests
first, one kernel each). The split costs a few gathers, so a step that is all decode or all prefill goes straight through,
and so does a step without states to continue (no cache: training and cache-free forwards).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from openk3.ops.kda.chunk import kda_chunk
from openk3.ops.kda.decode import kda_decode
from openk3.ops.kda.inference_only import refuse_autograd


def kda_mixed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    chunk: Callable[..., tuple[torch.Tensor, torch.Tensor]] = kda_chunk,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill contract (o [B, T, H, V], final state [N, H, K, V] fp32); equal to kda_chunk up to fp32 rounding.
    `chunk` is the chunkwise form the multi-token sequences take (kda_chunk, or chunk_c.kda_chunk_c)."""
    refuse_autograd("mixed", q)
    if initial_state is None or cu_seqlens is None:
        return chunk(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size)
    lens_N = cu_seqlens[1:] - cu_seqlens[:-1]
    single_N = lens_N == 1
    num_single = int(single_N.sum())
    if num_single == 0:
        return chunk(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size)
    if num_single == lens_N.numel():
        o, state = kda_decode(q[0], k[0], v[0], g[0], beta[0], initial_state, scale)
        return o.unsqueeze(0), state
    seq_T = torch.repeat_interleave(torch.arange(lens_N.numel(), device=lens_N.device), lens_N, output_size=q.shape[1])
    single_T = single_N.index_select(0, seq_T)
    dec_tok, pre_tok = single_T.nonzero().squeeze(1), (~single_T).nonzero().squeeze(1)
    dec_seq, pre_seq = single_N.nonzero().squeeze(1), (~single_N).nonzero().squeeze(1)
    q_d, k_d, v_d, g_d, beta_d = (x[0].index_select(0, dec_tok) for x in (q, k, v, g, beta))
    o_dec, s_dec = kda_decode(q_d, k_d, v_d, g_d, beta_d, initial_state.index_select(0, dec_seq), scale)
    pre_lens = lens_N.index_select(0, pre_seq)
    pre_cu = torch.cat([pre_lens.new_zeros(1), torch.cumsum(pre_lens, 0)])
    q_p, k_p, v_p, g_p, beta_p = (x[0].index_select(0, pre_tok).unsqueeze(0) for x in (q, k, v, g, beta))
    o_pre, s_pre = chunk(q_p, k_p, v_p, g_p, beta_p, scale, initial_state.index_select(0, pre_seq), pre_cu, chunk_size)
    # each token (sequence) is either a decode or a prefill one, so the two index_copy_ calls write all of o (state)
    o = o_pre.new_empty((q.shape[1], *o_pre.shape[2:]))
    o.index_copy_(0, dec_tok, o_dec.to(o.dtype)).index_copy_(0, pre_tok, o_pre[0])
    state = s_pre.new_empty(initial_state.shape)
    state.index_copy_(0, dec_seq, s_dec).index_copy_(0, pre_seq, s_pre)
    return o.unsqueeze(0), state
