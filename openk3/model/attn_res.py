"""Block Attention Residuals: each sublayer reads a softmax mix over depth (stored block outputs + the running partial sum)
instead of the plain residual stream.

Legend: T tokens, D hidden, S sources (stored blocks + 1 partial sum). A mixer is a pseudo-query (`*_res_proj`, a
bias-free Linear(D, 1), zero-initialised so that the mix starts uniform) and a key-norm weight (`*_res_norm`, [D]);
the math lives in openk3.ops.attn_res.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.model.layers import RMSNorm
from openk3.ops.attn_res import attn_res


def new_mixer(hidden: int, eps: float) -> tuple[nn.Linear, RMSNorm]:
    proj = nn.Linear(hidden, 1, bias=False)
    nn.init.zeros_(proj.weight)
    return proj, RMSNorm(hidden, eps)


def mix(blocks: list[torch.Tensor], partial_TD: torch.Tensor, proj: nn.Linear, norm: RMSNorm) -> torch.Tensor:
    sources_STD = torch.stack([*blocks, partial_TD], dim=0)
    return attn_res(sources_STD, proj.weight[0], norm.weight, norm.eps)
