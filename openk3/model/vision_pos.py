"""Where a patch is, for the MoonViT tower: the absolute position embedding (a learned [H0, W0, D] table resized to the
image's grid, plus a fixed sin-cos table over frames) and the 2D rotary angles of the attention.

Legend: t frames of a chunk, h x w its patch grid (rows x columns), D tower width, K head size, L = t h w patches in
(frame, row, column) order -- the order the processor emits patches in.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from openk3.config.vision import ROPE_MAX_GRID


class Grid(NamedTuple):
    """One image (t = 1) or video chunk: frames and the patch grid's rows and columns."""

    t: int
    h: int
    w: int

    @property
    def patches(self) -> int:
        return self.t * self.h * self.w


def resized_table(table_HWD: torch.Tensor, grid: Grid, mode: str) -> torch.Tensor:
    """The learned table at the image's grid: [h w, D], row-major. At the table's own size it is used as stored (the
    reference skips the interpolation there); otherwise F.interpolate with align_corners=False, as the reference."""
    if (grid.h, grid.w) == tuple(table_HWD.shape[:2]):
        return table_HWD.flatten(0, 1)
    resized = F.interpolate(table_HWD.permute(2, 0, 1).unsqueeze(0), size=(grid.h, grid.w), mode=mode)
    return resized.squeeze(0).permute(1, 2, 0).flatten(0, 1)


def time_table(frames: int, dim: int) -> torch.Tensor:
    """The fixed sin-cos table over frames: [frames, D], row f = [sin(f w_i), cos(f w_i)] with w_i = 10000^(-2i/D)
    (i < D/2), in fp32 (the reference computes it in numpy float32 and keeps it as a non-persistent buffer)."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float32) / (dim / 2.0))
    angles = torch.arange(frames, dtype=torch.float32)[:, None] * omega[None, :]
    return torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)


def position_embedding(table_HWD: torch.Tensor, grids: list[Grid], max_frames: int, mode: str) -> torch.Tensor:
    """[L, D] to add to the patch embeddings of all images, packed. A still image (t = 1) gets the spatial table alone;
    frame f of a chunk gets the spatial table plus row f of the time table."""
    out = []
    for g in grids:
        if g.t > max_frames:
            raise ValueError(f"a chunk of {g.t} frames exceeds the {max_frames} frames the time table holds (init_pos_emb_time)")
        spatial = resized_table(table_HWD, g, mode)
        if g.t == 1:
            out.append(spatial)
        else:
            times = time_table(g.t, table_HWD.shape[-1]).to(spatial.dtype)
            out.append((spatial[None] + times[:, None]).flatten(0, 1))
    return torch.cat(out)


def rope_angles(grids: list[Grid], head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """[L, K/2] fp32 rotation angles: pair 2i turns by column * f_i, pair 2i + 1 by row * f_i, f_i = theta^(-4i/K), the
    same for every frame of a chunk (as the reference's code orders them: x before y)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 4)[: head_dim // 4].float() / head_dim)
    out = []
    for g in grids:
        if not (1 <= g.h <= ROPE_MAX_GRID and 1 <= g.w <= ROPE_MAX_GRID):
            raise ValueError(f"a patch grid of {g.h} x {g.w} exceeds the rotary table's {ROPE_MAX_GRID} x {ROPE_MAX_GRID}")
        rows = torch.arange(g.h, dtype=torch.float32).repeat_interleave(g.w)
        cols = torch.arange(g.w, dtype=torch.float32).repeat(g.h)
        pairs = torch.stack([torch.outer(cols, freqs), torch.outer(rows, freqs)], dim=-1).flatten(1)
        out.append(pairs.repeat(g.t, 1))
    return torch.cat(out)


def apply_rope(x_LHK: torch.Tensor, angles_LP: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2j], x[2j+1]) by angles[:, j] (the same for every head), in fp32; back in x's dtype."""
    x = x_LHK.float().unflatten(-1, (-1, 2))
    cos, sin = torch.cos(angles_LP)[:, None], torch.sin(angles_LP)[:, None]
    x0, x1 = x[..., 0], x[..., 1]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2).to(x_LHK.dtype)
