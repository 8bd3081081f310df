"""The MoonViT3d vision tower (`vision_tower.*`): native-resolution patches -> patch embedding + interpolated position
table -> pre-norm encoder blocks with 2D rotary attention within each image -> final norm.

Legend: L patches of all images packed (each image's patches in (frame, row, column) order), C channels, P patch side,
D tower width (hidden_size), Q attention width (qkv_hidden_size), H heads, K = Q / H, I the MLP width.
Parameter names are the release's (`patch_embed.proj`, `patch_embed.pos_emb.weight`, `encoder.blocks.{i}.norm0 / wqkv /
wo / norm1 / mlp.fc0 / mlp.fc1`, `encoder.final_layernorm`), so state-dict keys need no renaming. The attention is the
registry's "vision_attn" chosen by name (select); everything else is plain torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from openk3.config.vision import VisionConfig, VisionNorm
from openk3.model.layers import Linear
from openk3.model.vision_pos import Grid, apply_rope, position_embedding, rope_angles
from openk3.ops.registry import CPU_INFERENCE, OpTarget, op

LAYERNORM_EPS = 1e-5  # nn.LayerNorm's default, which the reference's blocks use


class TowerNorm(nn.Module):
    """LayerNorm (weight and bias) or RMSNorm (weight). eps None: the machine epsilon of the input's dtype, as
    nn.RMSNorm(dim) without eps computes it (the K3 tower's norms: 2^-7 in bf16, 2^-23 in fp32)."""

    def __init__(self, dim: int, kind: VisionNorm, eps: float | None) -> None:
        super().__init__()
        self.kind, self.eps = kind, eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if kind == VisionNorm.LAYERNORM else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == VisionNorm.LAYERNORM:
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, LAYERNORM_EPS if self.eps is None else self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class VisionMLP(nn.Module):
    def __init__(self, dim: int, inner: int, bias: bool) -> None:
        super().__init__()
        self.fc0 = Linear(dim, inner, bias=bias)
        self.fc1 = Linear(inner, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(F.gelu(self.fc0(x), approximate="tanh"))


class VisionBlock(nn.Module):
    """x + wo(attn(rope(q), rope(k), v)) over norm0(x), then x + mlp(norm1(x))."""

    def __init__(self, v: VisionConfig, impl: str) -> None:
        super().__init__()
        self.heads, self.head_dim = v.num_attention_heads, v.head_dim
        eps = None if v.norm == VisionNorm.RMSNORM else LAYERNORM_EPS
        self.norm0 = TowerNorm(v.hidden_size, v.norm, eps)
        self.norm1 = TowerNorm(v.hidden_size, v.norm, eps)
        self.wqkv = Linear(v.hidden_size, 3 * v.attn_width, bias=v.attn_bias)
        self.wo = Linear(v.attn_width, v.hidden_size, bias=v.attn_bias)
        self.mlp = VisionMLP(v.hidden_size, v.intermediate_size, v.linear_bias)
        self.select(impl, CPU_INFERENCE)

    def select(self, impl: str, target: OpTarget) -> None:
        self.attention = op("vision_attn", impl, target)

    def forward(self, x_LD: torch.Tensor, angles_LP: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        q, k, v = self.wqkv(self.norm0(x_LD)).view(x_LD.shape[0], 3, self.heads, self.head_dim).unbind(1)
        attn_LHK = self.attention(apply_rope(q, angles_LP), apply_rope(k, angles_LP), v, lengths)
        x_LD = x_LD + self.wo(attn_LHK.flatten(1))
        return x_LD + self.mlp(self.norm1(x_LD))


class PositionTable(nn.Module):
    """The learned [H0, W0, D] table (`patch_embed.pos_emb.weight`); the time table is fixed, computed, never stored."""

    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(v.pos_emb_height, v.pos_emb_width, v.hidden_size))
        self.frames, self.mode = v.pos_emb_time, v.pos_emb_interpolation

    def forward(self, grids: list[Grid]) -> torch.Tensor:
        return position_embedding(self.weight, grids, self.frames, self.mode)


class PatchEmbed(nn.Module):
    """Each P x P patch through one convolution whose stride is its kernel (a linear map of the patch), plus its position."""

    def __init__(self, v: VisionConfig) -> None:
        super().__init__()
        p = v.patch_size
        self.proj = nn.Conv2d(v.in_channels, v.hidden_size, kernel_size=p, stride=p, bias=v.patch_embed_bias)
        self.pos_emb = PositionTable(v)

    def forward(self, pixels_LCPP: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        want = (sum(g.patches for g in grids), self.proj.in_channels, *self.proj.kernel_size)
        if tuple(pixels_LCPP.shape) != want:
            raise ValueError(f"pixel values have shape {tuple(pixels_LCPP.shape)}, expected {want} (patches of grids {grids})")
        x_LD = self.proj(pixels_LCPP.to(self.proj.weight.dtype)).flatten(1)
        return x_LD + self.pos_emb(grids)


class VisionEncoder(nn.Module):
    def __init__(self, v: VisionConfig, impl: str) -> None:
        super().__init__()
        self.head_dim = v.head_dim
        self.blocks = nn.ModuleList(VisionBlock(v, impl) for _ in range(v.num_hidden_layers))
        self.final_layernorm = TowerNorm(v.hidden_size, v.norm, None if v.norm == VisionNorm.RMSNORM else LAYERNORM_EPS)

    def forward(self, x_LD: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        angles = rope_angles(grids, self.head_dim).to(x_LD.device)
        lengths = [g.patches for g in grids]
        for block in self.blocks:
            x_LD = block(x_LD, angles, lengths)
        return self.final_layernorm(x_LD)


class MoonViT(nn.Module):
    """`vision_tower`: pixel patches [L, C, P, P] of packed images with their grids -> hidden states [L, D]."""

    def __init__(self, v: VisionConfig, impl: str = "auto") -> None:
        super().__init__()
        self.config = v
        self.patch_embed = PatchEmbed(v)
        self.encoder = VisionEncoder(v, impl)

    def forward(self, pixels_LCPP: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        grid_list = [Grid(*map(int, g)) for g in grids]
        kh, kw = self.config.merge_kernel_size
        bad = [g for g in grid_list if min(g) < 1 or g.h % kh or g.w % kw]
        if bad:
            raise ValueError(f"grid {tuple(bad[0])}: every (t, h, w) must be positive with h, w multiples of the merge kernel {kh}x{kw}")
        return self.encoder(self.patch_embed(pixels_LCPP, grid_list), grid_list)

    def select(self, impl: str, target: OpTarget) -> None:
        for block in self.encoder.blocks:
            assert isinstance(block, VisionBlock)
            block.select(impl, target)
