"""Byte layout of an FP8 MLA latent cache row (no torch here: the planner sizes it too). ops/mla/fp8_latent.py packs and
unpacks rows in this layout: R float8_e4m3fn values, then one fp32 scale per FP8_GROUP channels."""

from __future__ import annotations

FP8_GROUP = 64  # latent channels per scale (K3's 576 = 9 groups; FlashMLA scales its 512 c_kv channels in tiles of 128)


def fp8_groups(latent_dim: int) -> int:
    return -(-latent_dim // FP8_GROUP)


def fp8_latent_width(latent_dim: int) -> int:
    """Bytes of one token's packed row: R e4m3 values and G fp32 scales."""
    return latent_dim + 4 * fp8_groups(latent_dim)
