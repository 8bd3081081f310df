"""Block Attention Residuals: each sublayer reads a softmax mix over depth (stored block outputs + the running partial sum)
instead of the plain residual stream.

Legend: T tokens, D hidden, S sources (stored blocks + 1 partial sum), B stored blocks, Q mixers of one AttnRes block. A mixer
is a pseudo-query (`*_res_proj`, a bias-free Linear(D, 1), zero-initialised so that the mix starts uniform) and a key-norm
weight (`*_res_norm`, [D]); the math lives in openk3.ops.attn_res.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from openk3.model.layers import RMSNorm
from openk3.ops.attn_res import attn_res, attn_res_merge, attn_res_phase1
from openk3.ops.thresholds import TWO_PHASE_MIN_TOKENS  # below it "auto" keeps the one-shot mix (the measurement is there)


class Mixer(NamedTuple):
    proj: nn.Linear
    norm: RMSNorm


def new_mixer(hidden: int, eps: float) -> tuple[nn.Linear, RMSNorm]:
    proj = nn.Linear(hidden, 1, bias=False)
    nn.init.zeros_(proj.weight)
    return proj, RMSNorm(hidden, eps)


def mix(blocks: list[torch.Tensor], partial_TD: torch.Tensor, proj: nn.Linear, norm: RMSNorm) -> torch.Tensor:
    """One-shot mix (the reference): stacks and re-normalises every stored block on each call."""
    sources_STD = torch.stack([*blocks, partial_TD], dim=0)
    return attn_res(sources_STD, proj.weight[0], norm.weight, norm.eps)


def use_two_phase(impl: str, tokens: int) -> bool:
    """Whether a step of `tokens` tokens takes the two-phase evaluation under implementation `impl` (a resolved name of
    ops/registry.py "attn_res": naive, fast or sized)."""
    return impl == "fast" or (impl == "sized" and tokens >= TWO_PHASE_MIN_TOKENS)


class BlockMixes:
    """Two-phase AttnRes over one AttnRes block. Built right after the block's input has been appended to `blocks`: from
    then until the next block starts, the stored blocks are fixed, so phase 1 scores all of the block's mixers against
    them at once (each block read and normalised once per block instead of once per sublayer). Each sublayer then only
    merges its one extra source, the current partial sum (phase 2).

    `mixers` are exactly those whose block set is this one; a mixer is found again by its pseudo-query module."""

    def __init__(self, blocks: list[torch.Tensor], mixers: list[Mixer]) -> None:
        self._slot = {m.proj: q for q, m in enumerate(mixers)}
        queries_QD = torch.stack([m.proj.weight[0] for m in mixers])
        norms_QD = torch.stack([m.norm.weight for m in mixers])
        self._partial = attn_res_phase1(torch.stack(blocks), queries_QD, norms_QD, mixers[0].norm.eps)
        self._dtype = blocks[-1].dtype

    def blocks_only(self, mixer: Mixer) -> torch.Tensor:
        """The mix over the stored blocks alone: the first layer of a block, whose partial sum was just stored as a block."""
        return self._partial.out_QND[self._slot[mixer.proj]].to(self._dtype)

    def merge(self, mixer: Mixer, partial_TD: torch.Tensor) -> torch.Tensor:
        """The mix over the stored blocks and the current partial sum."""
        return attn_res_merge(self._partial, self._slot[mixer.proj], partial_TD, mixer.proj.weight[0], mixer.norm.weight, mixer.norm.eps)
