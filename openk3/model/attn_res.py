"""Block Attention Residuals: each sublayer reads a softmax mix over depth (stored block outputs + the running partial sum)
instead of the plain residual stream.

Legend: T tokens, D hidden. A mixer is a pseudo-query (`*_res_proj`, a bias-free Linear(D, 1), zero-initialised so that the
mix starts uniform) and a key-norm weight (`*_res_norm`, [D]); the math and its forms (one-shot, two-phase) live in
openk3.ops.attn_res, whose residual streams the layer loop of model/model.py reads. PlainResidual is the same interface
for a model without AttnRes, so that one loop serves both.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from openk3.model.layers import RMSNorm
from openk3.ops.attn_res import MixQuery


def new_mixer(hidden: int, eps: float) -> tuple[nn.Linear, RMSNorm]:
    proj = nn.Linear(hidden, 1, bias=False)
    nn.init.zeros_(proj.weight)
    return proj, RMSNorm(hidden, eps)


def mix_query(key: int, proj: nn.Linear, norm: RMSNorm) -> MixQuery:
    return MixQuery(key, proj.weight[0], norm.weight, norm.eps)


class PlainResidual:
    """The residual stream without AttnRes: a read is the running sum, an add adds to it (no blocks, no mixers)."""

    def __init__(self, embed_TD: torch.Tensor) -> None:
        self._h = embed_TD

    def start_block(self, readers: Sequence[MixQuery]) -> None:
        raise AssertionError("a model without AttnRes has no blocks")

    def read(self, mixer: MixQuery | None) -> torch.Tensor:
        return self._h

    def add(self, out_TD: torch.Tensor) -> None:
        self._h = self._h + out_TD

    def partial(self) -> torch.Tensor:
        return self._h
