"""Attention Residuals mixer, one-shot: the definition, and the residual stream that applies it at every read ("naive").

Legend: S sources (the stored blocks followed by the current partial sum), N tokens, D hidden width.

Each token mixes its own S depth-wise sources with a learned pseudo-query w (scaled elementwise by the norm weight gamma):
K = V / sqrt(mean_D(V^2) + eps), logits[s, n] = K[s, n] . (gamma * w), p = softmax over s, out[n] = sum_s p[s, n] V[s, n].
Gamma is folded into the query rather than into K, so K itself is an unweighted RMS normalisation; values are not normalised.
All math is fp32 because the softmax over a handful of sources is sensitive to bf16 rounding of the logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from openk3.ops.attn_res.stream import MixQuery


def check_query(name: str, query_D: torch.Tensor, norm_weight_D: torch.Tensor, width: int) -> None:
    if query_D.shape != (width,):
        raise ValueError(f"attn_res {name}: query shape {tuple(query_D.shape)}, expected ({width},) (the sources' hidden width)")
    if norm_weight_D.shape != (width,):
        raise ValueError(f"attn_res {name}: norm_weight shape {tuple(norm_weight_D.shape)}, expected ({width},)")


def rms_keys(values: torch.Tensor, eps: float) -> torch.Tensor:
    """K = V / sqrt(mean(V^2) + eps) over the last dimension, fp32 (no weight: gamma lives in the query)."""
    v32 = values.float()
    return v32 * torch.rsqrt(v32.pow(2).mean(-1, keepdim=True) + eps)


def attn_res(sources_SND: torch.Tensor, query_D: torch.Tensor, norm_weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """Softmax-over-depth mix of S sources per token; returns [N, D] in the sources' dtype."""
    if sources_SND.dim() != 3 or sources_SND.shape[0] < 1:
        raise ValueError(f"attn_res: sources shape {tuple(sources_SND.shape)}, expected [S >= 1, N, D]")
    check_query("one-shot", query_D, norm_weight_D, sources_SND.shape[-1])
    v32 = sources_SND.float()
    q32 = norm_weight_D.float() * query_D.float()
    logits_SN = rms_keys(v32, eps) @ q32
    p_SN = torch.softmax(logits_SN, dim=0)
    out_ND = (p_SN.unsqueeze(-1) * v32).sum(0)
    return out_ND.to(sources_SND.dtype)


class OneShotStream:
    """The "naive" form of ops/attn_res/stream.py's DepthStream: every read stacks and re-normalises all its sources."""

    def __init__(self, embed_TD: torch.Tensor) -> None:
        self._blocks: list[torch.Tensor] = []
        self._partial: torch.Tensor | None = embed_TD

    def start_block(self, readers: Sequence[MixQuery]) -> None:
        assert self._partial is not None, "start_block twice without a sublayer between"
        self._blocks.append(self._partial)
        self._partial = None

    def read(self, mixer: MixQuery | None) -> torch.Tensor:
        sources = self._blocks if self._partial is None else [*self._blocks, self._partial]
        if len(sources) == 1:
            return sources[0]
        assert mixer is not None, "an AttnRes read names its mixer"
        return attn_res(torch.stack(sources), mixer.query_D, mixer.norm_weight_D, mixer.eps)

    def add(self, out_TD: torch.Tensor) -> None:
        self._partial = out_TD if self._partial is None else self._partial + out_TD

    def partial(self) -> torch.Tensor:
        assert self._partial is not None, "no partial sum right after start_block"
        return self._partial
