"""The short conv's decode step with the window advanced in place: the serving step's fast path.

Legend: N sequences, C channels, W kernel width. x [N, C] (one new pre-conv input per sequence); state [N, C, W-1] (a view of
the slot pool when the step's slots are consecutive, else a gathered copy the caller writes back).

Why: causal_conv1d_update leaves its input state untouched and returns the new window, so the caller gathers the slots,
and scatters the new windows back: at 16 sequences those copies cost as much as the convolution itself. Here the window is
read and shifted where it lives. Same numbers as causal_conv1d_update (fp32 math, the state keeps its dtype).
"""

from __future__ import annotations

import torch

from openk3.ops.short_conv.naive import activate, decode_window


def causal_conv1d_update_(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, activation: str | None = "silu") -> torch.Tensor:
    """One token per sequence; `state` is advanced in place. Returns y [N, C] in x.dtype."""
    full, w = decode_window("causal_conv1d_update_", x, weight, state)
    y = activate((full * w).sum(dim=2), activation)
    state.copy_(full[:, :, 1:])
    return y.to(x.dtype)
