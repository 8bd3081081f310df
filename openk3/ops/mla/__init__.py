"""MLA attention ops: `mla_expanded` (reference, prefill), `mla_expanded_sdpa`, `mla_absorbed` (latent-space form) -- the
prefill implementations of ops/registry.py "mla_prefill" -- and `mla_decode_paged` (batched decode over pages)."""

from __future__ import annotations

from openk3.ops.mla.absorbed import mla_absorbed, mla_decode_paged
from openk3.ops.mla.naive import causal_mask, mla_expanded, split_kv_b
from openk3.ops.mla.sdpa import mla_expanded_sdpa

__all__ = ["causal_mask", "mla_absorbed", "mla_decode_paged", "mla_expanded", "mla_expanded_sdpa", "split_kv_b"]
