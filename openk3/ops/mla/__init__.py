"""MLA attention ops: `mla_expanded` (reference, prefill), `mla_absorbed` (latent-space form), `mla_decode_paged` (batched decode over pages)."""

from __future__ import annotations

from collections.abc import Callable

from openk3.ops.mla.absorbed import mla_absorbed, mla_decode_paged
from openk3.ops.mla.naive import causal_mask, mla_expanded, split_kv_b
from openk3.ops.mla.sdpa import mla_expanded_sdpa

MLA_PREFILL_IMPLS: dict[str, Callable] = {"naive": mla_expanded, "fast": mla_expanded_sdpa, "absorbed": mla_absorbed}


def mla_prefill_op(impl: str) -> Callable:
    """Prefill attends over expanded K/V (cheap when queries are many); "absorbed" is the latent-space equivalent."""
    if impl == "auto":
        impl = "fast"
    try:
        return MLA_PREFILL_IMPLS[impl]
    except KeyError:
        raise ValueError(f"unknown MLA prefill implementation {impl!r}; choose one of {sorted(MLA_PREFILL_IMPLS) + ['auto']}") from None


__all__ = ["causal_mask", "mla_absorbed", "mla_decode_paged", "mla_expanded", "mla_expanded_sdpa", "mla_prefill_op", "split_kv_b"]
