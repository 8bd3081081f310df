"""The MLA latent cache in FP8: each token's latent row stored as e4m3 values with one fp32 scale per group of channels.

Layout of one token's row in a page (uint8, `config.cache_format.fp8_latent_width(R)` bytes): the R latent values as float8_e4m3fn, then
ceil(R / FP8_GROUP) fp32 scales, byte for byte. Keeping the scales in the row (as FlashMLA's FP8 cache keeps its per-tile
scales beside the values) means every copy of pages -- prefix snapshots, host and disk tiers, the prefill/decode hand-off,
the multi-rank replay -- moves them with the values without knowing the format. A group's scale is its absolute maximum
over e4m3's largest value (448), so the largest value of each group is exact up to e4m3's 3-bit mantissa; an all-zero group
gets scale 1. Values are rounded to nearest by torch's cast.
Legend: X rows (tokens), R latent width, G scale groups, W bytes per row.
"""

from __future__ import annotations

import torch

from openk3.config.cache_format import FP8_GROUP, fp8_groups

E4M3_MAX = 448.0


def _grouped(x_XR: torch.Tensor) -> torch.Tensor:
    """[X, G, FP8_GROUP], the last group zero-padded."""
    r = x_XR.shape[-1]
    pad = fp8_groups(r) * FP8_GROUP - r
    return torch.nn.functional.pad(x_XR, (0, pad)).view(x_XR.shape[0], -1, FP8_GROUP)


def pack_fp8_latent(latent_XR: torch.Tensor) -> torch.Tensor:
    """[X, R] latents (any float dtype) -> [X, W] uint8 packed rows."""
    x, r = latent_XR.shape
    g = _grouped(latent_XR.float())
    scale_XG = g.abs().amax(dim=-1) / E4M3_MAX
    scale_XG = torch.where(scale_XG > 0, scale_XG, torch.ones_like(scale_XG))
    values = (g / scale_XG.unsqueeze(-1)).view(x, -1)[:, :r].to(torch.float8_e4m3fn)
    return torch.cat([values.view(torch.uint8), scale_XG.contiguous().view(torch.uint8).view(x, -1)], dim=-1)


def unpack_fp8_latent(packed_XW: torch.Tensor, latent_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """[..., W] packed rows -> [..., R] latents in `dtype` (the values times their group's scale)."""
    lead = packed_XW.shape[:-1]
    rows = packed_XW.reshape(-1, packed_XW.shape[-1])
    values = rows[:, :latent_dim].contiguous().view(torch.float8_e4m3fn).float()
    scale_XG = rows[:, latent_dim:].contiguous().view(torch.float32)
    out = (_grouped(values) * scale_XG.unsqueeze(-1)).view(rows.shape[0], -1)[:, :latent_dim]
    return out.to(dtype).reshape(*lead, latent_dim)
