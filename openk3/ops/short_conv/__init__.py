"""Causal depthwise short convolution with carried state (KDA's q/k/v convs). Prefill chosen by name; decode is causal_conv1d_update
(state read only) or causal_conv1d_update_ (state advanced in place, the serving path)."""

from __future__ import annotations

from collections.abc import Callable

from openk3.ops.short_conv import fast, naive
from openk3.ops.short_conv.naive import causal_conv1d_update
from openk3.ops.short_conv.update_inplace import causal_conv1d_update_

_PREFILL = {"naive": naive.causal_conv1d, "fast": fast.causal_conv1d, "auto": fast.causal_conv1d}


def causal_conv1d_op(impl: str) -> Callable:
    """The short-conv prefill function for impl in {naive, fast, auto}."""
    if impl not in _PREFILL:
        raise ValueError(f"causal_conv1d_op: impl={impl!r} is invalid: expected one of {sorted(_PREFILL)}")
    return _PREFILL[impl]


__all__ = ["causal_conv1d_op", "causal_conv1d_update", "causal_conv1d_update_"]
