"""Attention Residuals, two-phase evaluation: an exact reorganisation of the one-shot mixer, and the residual stream that
evaluates it ("fast").

Legend: B completed blocks (nb), Q pseudo-queries of one AttnRes block, N tokens, D hidden width.

Within an AttnRes block the completed blocks do not change; only the current partial sum does. Phase 1 therefore scores all
Q pseudo-queries of the block against the B completed blocks at once (one batched einsum, the blocks read once) and keeps,
per query and token, the softmax-weighted mean over the blocks and its log-sum-exp. Phase 2, once per sublayer, adds the single
extra source (the partial sum) with an online-softmax update:
lse' = logaddexp(lse, l), out' = out * exp(lse - lse') + prefix * exp(l - lse'),
i.e. a two-way softmax over (lse, l) weighting (out, prefix), which is how it is computed.
This equals softmax over all B + 1 sources because softmax normalisation factors through the log-sum-exp.
Both phases score a source as (V . q) * rsqrt(mean(V^2) + eps), the same number as K . q without materialising K.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from openk3.ops.attn_res.naive import check_query
from openk3.ops.attn_res.stream import MixQuery


class BlockPartial(NamedTuple):
    out_QND: torch.Tensor  # fp32 softmax-weighted mean over the completed blocks, per pseudo-query
    lse_QN: torch.Tensor  # fp32 log-sum-exp of those logits


def attn_res_phase1(blocks_BND: torch.Tensor, queries_QD: torch.Tensor, norm_weights_QD: torch.Tensor, eps: float) -> BlockPartial:
    if blocks_BND.dim() != 3 or blocks_BND.shape[0] < 1:
        raise ValueError(f"attn_res_phase1: blocks shape {tuple(blocks_BND.shape)}, expected [nb >= 1, N, D]")
    width = blocks_BND.shape[-1]
    if queries_QD.dim() != 2 or queries_QD.shape[1] != width or queries_QD.shape[0] < 1:
        raise ValueError(f"attn_res_phase1: queries shape {tuple(queries_QD.shape)}, expected [Q >= 1, {width}]")
    if norm_weights_QD.shape != queries_QD.shape:
        raise ValueError(f"attn_res_phase1: norm_weights shape {tuple(norm_weights_QD.shape)}, expected {tuple(queries_QD.shape)}")
    v32 = blocks_BND.float()
    q32 = norm_weights_QD.float() * queries_QD.float()
    logits_QBN = torch.einsum("bnd,qd->qbn", v32, q32) * _inv_rms(v32, eps)
    lse_QN = torch.logsumexp(logits_QBN, dim=1)
    p_QBN = torch.exp(logits_QBN - lse_QN.unsqueeze(1))
    # The weighted sum over the few blocks as B multiply-adds into a contiguous [Q, N, D]: einsum runs it as N tiny
    # [Q, B] x [B, D] matmuls on permuted copies (measured ~5x slower on CPU at B=4, Q=9, N=D=256) and returns a strided view.
    out_QND = p_QBN[:, 0].unsqueeze(-1) * v32[0]
    for b in range(1, v32.shape[0]):
        out_QND = out_QND.addcmul_(p_QBN[:, b].unsqueeze(-1), v32[b])
    return BlockPartial(out_QND, lse_QN)


def attn_res_merge(partial: BlockPartial, q: int, prefix_ND: torch.Tensor, query_D: torch.Tensor, norm_weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """Mix pseudo-query q's block partial with the current partial sum; returns [N, D] in prefix's dtype."""
    num_q, n_tok, width = partial.out_QND.shape
    if not 0 <= q < num_q:
        raise ValueError(f"attn_res_merge: q={q} out of range, expected 0..{num_q - 1}")
    if prefix_ND.shape != (n_tok, width):
        raise ValueError(f"attn_res_merge: prefix shape {tuple(prefix_ND.shape)}, expected ({n_tok}, {width}) to match phase 1")
    check_query("merge", query_D, norm_weight_D, width)
    p32 = prefix_ND.float()
    logit_N = (p32 @ (norm_weight_D.float() * query_D.float())) * _inv_rms(p32, eps)
    w_2N = torch.softmax(torch.stack([partial.lse_QN[q], logit_N]), dim=0)
    out_ND = torch.addcmul(partial.out_QND[q] * w_2N[0].unsqueeze(-1), p32, w_2N[1].unsqueeze(-1))
    return out_ND.to(prefix_ND.dtype)


def _inv_rms(v32: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(v32.square().mean(-1) + eps)


class TwoPhaseStream:
    """The "fast" form of ops/attn_res/stream.py's DepthStream. From start_block until the next block the stored blocks are
    fixed, so phase 1 scores all of the block's readers against them at once (each block read and normalised once per
    block instead of once per sublayer); each read then only merges the one extra source, the current partial sum.
    The first reader of a block mixes the old blocks and the partial sum just stored, i.e. exactly the new block set, so it
    reads phase 1's output alone."""

    def __init__(self, embed_TD: torch.Tensor) -> None:
        self._blocks: list[torch.Tensor] = []
        self._partial: torch.Tensor | None = embed_TD
        self._phase: BlockPartial | None = None
        self._slot: dict[int, int] = {}  # MixQuery.key -> its row of phase 1

    def start_block(self, readers: Sequence[MixQuery]) -> None:
        assert self._partial is not None, "start_block twice without a sublayer between"
        self._blocks.append(self._partial)
        self._partial = None
        self._slot = {m.key: q for q, m in enumerate(readers)}
        queries_QD = torch.stack([m.query_D for m in readers])
        norms_QD = torch.stack([m.norm_weight_D for m in readers])
        self._phase = attn_res_phase1(torch.stack(self._blocks), queries_QD, norms_QD, readers[0].eps)

    def read(self, mixer: MixQuery | None) -> torch.Tensor:
        if self._partial is None and len(self._blocks) == 1:
            return self._blocks[0]
        assert self._phase is not None and mixer is not None, "an AttnRes read after start_block names its mixer"
        slot = self._slot[mixer.key]
        if self._partial is None:
            return self._phase.out_QND[slot].to(self._blocks[-1].dtype)
        return attn_res_merge(self._phase, slot, self._partial, mixer.query_D, mixer.norm_weight_D, mixer.eps)

    def add(self, out_TD: torch.Tensor) -> None:
        self._partial = out_TD if self._partial is None else self._partial + out_TD

    def partial(self) -> torch.Tensor:
        assert self._partial is not None, "no partial sum right after start_block"
        return self._partial
