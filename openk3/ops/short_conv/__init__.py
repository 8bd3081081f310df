"""Causal depthwise short convolution with carried state (KDA's q/k/v convs). Prefill chosen by name (ops/registry.py
"short_conv": naive, fast); decode is causal_conv1d_update (state read only) or causal_conv1d_update_ (state advanced in
place, the serving path)."""

from __future__ import annotations

from openk3.ops.short_conv import fast, naive
from openk3.ops.short_conv.naive import causal_conv1d_update
from openk3.ops.short_conv.update_inplace import causal_conv1d_update_

__all__ = ["causal_conv1d_update", "causal_conv1d_update_", "fast", "naive"]
