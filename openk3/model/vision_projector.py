"""From the tower's patches to text-width embeddings: temporal pooling and the spatial patch merger (`sd2_tpool`), then
the projector (`mm_projector.*`, `patchmergerv2` in K3, `patchmerger` in Kimi K2.5).

Legend: L packed patches, D tower width, kh x kw the merge kernel, k = kh kw, N merged tokens of all images
(per chunk (h / kh)(w / kw): frames are averaged away), T the text model's hidden size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from openk3.config.vision import Projector, VisionConfig, VisionNorm
from openk3.model.layers import Linear
from openk3.model.vision import TowerNorm
from openk3.model.vision_pos import Grid


def merged_tokens(grid: tuple[int, int, int], kernel: tuple[int, int]) -> int:
    """How many text-width embeddings one image or chunk becomes: (h / kh) (w / kw)."""
    return (grid[1] // kernel[0]) * (grid[2] // kernel[1])


def tpool_merge(x_LD: torch.Tensor, grids: Sequence[tuple[int, int, int]], kernel: tuple[int, int]) -> torch.Tensor:
    """[N, k, D]: per chunk, the mean over its frames of each kh x kw window of patches, the window's patches in row-major
    order and the windows in row-major order over the grid."""
    kh, kw = kernel
    out, start = [], 0
    for t, h, w in (Grid(*map(int, g)) for g in grids):
        seq = x_LD[start : start + t * h * w].view(t, h // kh, kh, w // kw, kw, -1)
        out.append(seq.permute(0, 1, 3, 2, 4, 5).mean(dim=0).reshape((h // kh) * (w // kw), kh * kw, -1))
        start += t * h * w
    if start != x_LD.shape[0]:
        raise ValueError(f"grids {list(grids)} cover {start} patches, the tower returned {x_LD.shape[0]}")
    return torch.cat(out)


class PatchMergerProjector(nn.Module):
    """`mm_projector`: the k patches of a window side by side ([N, k D]) through Linear -> GELU (erf) -> Linear, with
    `patchmergerv2` (K3) bias-free and followed by an RMSNorm (`post_norm`), with `patchmerger` (K2.5) preceded by a
    LayerNorm of each patch (`pre_norm`) and with biases. `proj.0` / `proj.2` are the checkpoint's nn.Sequential names."""

    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        self.kind = v.projector
        bias = v.projector == Projector.PATCHMERGER
        if bias:
            self.pre_norm = TowerNorm(v.hidden_size, VisionNorm.LAYERNORM, v.projector_ln_eps)
        self.proj = nn.Sequential(Linear(v.merged_size, v.merged_size, bias=bias), nn.GELU(), Linear(v.merged_size, v.text_hidden_size, bias=bias))
        if not bias:
            self.post_norm = TowerNorm(v.text_hidden_size, VisionNorm.RMSNORM, v.projector_ln_eps)

    def forward(self, x_NkD: torch.Tensor) -> torch.Tensor:
        if self.kind == Projector.PATCHMERGER:
            return self.proj(self.pre_norm(x_NkD).flatten(1))
        return self.post_norm(self.proj(x_NkD.flatten(1)))
