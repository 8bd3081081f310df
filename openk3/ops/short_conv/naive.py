"""Causal depthwise short convolution with carried state, by definition: a per-token loop in fp32.

Legend: B batch, T tokens, C channels, W kernel width, N sequences (N = B, or len(cu_seqlens) - 1 when packed, then B = 1).
x [B, T, C]; weight [C, W] (or the checkpoint's [C, 1, W]); state [N, C, W-1] = the last W-1 *pre-conv* inputs, oldest first.
y_t[c] = act(sum_w weight[c, w] * window_t[c, w]) with window_t = (the W-1 inputs before t, x_t); weight[:, -1] meets x_t.
Sequences shorter than W-1 keep part of the old state: the new inputs shift in after the old ones.
The final state is returned in initial_state's dtype when one is given, else in x's (inputs are stored, not computed, so no rounding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "silu")


def conv_weight(weight: torch.Tensor, C: int) -> torch.Tensor:
    """[C, W] or [C, 1, W] -> fp32 [C, W]."""
    if weight.dim() == 3 and weight.shape[1] == 1:
        weight = weight[:, 0]
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 1:
        raise ValueError(f"causal_conv1d: weight must be [C, W] or [C, 1, W] with C={C}, got {tuple(weight.shape)}")
    return weight.float()


def activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation={activation!r} is invalid: expected one of {list(ACTIVATIONS)}")
    return F.silu(y) if activation == "silu" else y


def check_conv_inputs(x: torch.Tensor, W: int, initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None) -> int:
    """Validate shapes; returns N, the number of sequences."""
    if x.dim() != 3:
        raise ValueError(f"causal_conv1d: x must be [B, T, C], got {tuple(x.shape)}")
    B, T, C = x.shape
    if cu_seqlens is None:
        N = B
    else:
        if B != 1:
            raise ValueError(f"causal_conv1d: with cu_seqlens the batch must be packed into B=1, got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T:
            raise ValueError(f"causal_conv1d: cu_seqlens must be [N+1] from 0 to T={T}, got {cu_seqlens.tolist()}")
        if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise ValueError(f"causal_conv1d: cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}")
        N = cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (N, C, W - 1):
        raise ValueError(f"causal_conv1d: initial_state must be [N, C, W-1] = {[N, C, W - 1]}, got {tuple(initial_state.shape)}")
    return N


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns y [B, T, C] in x.dtype and final_state [N, C, W-1]."""
    C = x.shape[-1]
    w = conv_weight(weight, C)
    W = w.shape[1]
    N = check_conv_inputs(x, W, initial_state, cu_seqlens)
    activate(x.new_zeros(()), activation)
    B, T, _ = x.shape
    state_dtype = x.dtype if initial_state is None else initial_state.dtype
    bounds = None if cu_seqlens is None else cu_seqlens.tolist()
    spans = [(b, 0, T) for b in range(B)] if bounds is None else [(0, bounds[n], bounds[n + 1]) for n in range(N)]
    y = torch.zeros(B, T, C, dtype=torch.float32, device=x.device)
    final = torch.empty(N, C, W - 1, dtype=state_dtype, device=x.device)
    for n, (row, start, end) in enumerate(spans):
        window = torch.zeros(C, W - 1, device=x.device) if initial_state is None else initial_state[n].float()
        for t in range(start, end):
            full = torch.cat((window, x[row, t].float()[:, None]), dim=1)  # [C, W], oldest first
            y[row, t] = activate((full * w).sum(dim=1), activation)
            window = full[:, 1:]
        final[n] = window.to(state_dtype)
    return y.to(x.dtype), final


def decode_window(name: str, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's inputs checked: (full [N, C, W] fp32 = the window then the new input, oldest first; w [C, W] fp32)."""
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be [N, C], got {tuple(x.shape)}")
    N, C = x.shape
    w = conv_weight(weight, C)
    if state.shape != (N, C, w.shape[1] - 1):
        raise ValueError(f"{name}: state must be [N, C, W-1] = {[N, C, w.shape[1] - 1]}, got {tuple(state.shape)}")
    return torch.cat((state.float(), x.float()[:, :, None]), dim=2), w


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: x [N, C], state [N, C, W-1] -> (y [N, C] in x.dtype, new_state [N, C, W-1] in state.dtype).

    The state is read, never written: the caller commits new_state (a prefix-cache snapshot must stay intact)."""
    full, w = decode_window("causal_conv1d_update", x, weight, state)
    y = activate((full * w).sum(dim=2), activation)
    return y.to(x.dtype), full[:, :, 1:].to(state.dtype)
