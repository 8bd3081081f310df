"""The residual stream over depth that a decoder's layer loop reads and adds to: one interface for every AttnRes form
("attn_res" in ops/registry.py: naive one-shot, fast two-phase, sized by the step), built from the embedding per forward.

Legend: T tokens, D hidden. The loop, per layer: at the first layer of an AttnRes block start_block (the running partial
sum becomes a stored block), then input = read(attention's mixer), add(attention output), input = read(MLP's mixer),
add(MLP output); after the last layer read(the output mixer). A read mixes the stored blocks and the partial sum (the
blocks alone right after start_block); a single source is its own mix (the first layer reads the embedding unmixed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch


class MixQuery(NamedTuple):
    """One mixer: a pseudo-query (`*_res_proj`) and key-norm weight (`*_res_norm`); `key` names it within the model, so a
    form that scores several mixers at once finds each one's result again."""

    key: int
    query_D: torch.Tensor
    norm_weight_D: torch.Tensor
    eps: float


class DepthStream(Protocol):
    def start_block(self, readers: Sequence[MixQuery]) -> None:
        """Store the partial sum as a block; `readers` are the mixers that read this block set (until the next block)."""
        ...

    def read(self, mixer: MixQuery | None) -> torch.Tensor:
        """A sublayer's input [T, D] in the stream's dtype (mixer None: a stream without mixers, model/attn_res.py's plain one)."""
        ...

    def add(self, out_TD: torch.Tensor) -> None:
        """Add a sublayer's output to the partial sum (it becomes the partial sum right after start_block)."""
        ...

    def partial(self) -> torch.Tensor:
        """The running partial sum [T, D] (the embedding before the first sublayer; not callable right after start_block):
        what an EAGLE-3 draft reads as a layer's hidden state (model/model.py K3Model.forward_with_aux)."""
        ...
