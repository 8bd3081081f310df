"""Bidirectional attention of the vision tower over packed images: `vision_attention_naive` (the definition) and
`vision_attention_sdpa` (torch's SDPA per image), the implementations of ops/registry.py "vision_attn"."""

from __future__ import annotations

from openk3.ops.vision_attn.naive import vision_attention_naive
from openk3.ops.vision_attn.sdpa import vision_attention_sdpa

__all__ = ["vision_attention_naive", "vision_attention_sdpa"]
