"""Causal depthwise short convolution, vectorised: W shifted multiply-adds over the state-prefixed inputs.

Legend and conventions as in naive.py: x [B, T, C], weight [C, W] or [C, 1, W], state [N, C, W-1] of pre-conv inputs, oldest first.
Packed sequences (cu_seqlens) are laid out in one buffer as [state_0, x_0, state_1, x_1, ...]; a valid (unpadded) convolution over it
never mixes sequences at the positions we read, because each token's window of W reaches back only into its own W-1 state slots.
The convolution is spelled as W multiply-adds of the buffer shifted along its token axis, in the token-major layout the
projections produce: a grouped F.conv1d wants channels-major input and took ~8 ms per KDA layer for 2048 packed tokens on CPU
(two transposing copies and oneDNN's depthwise kernel), the shifted sums about a tenth of that.
The decode step is already one vectorised expression, so causal_conv1d_update is the reference one.
"""

from __future__ import annotations

import torch

from openk3.ops.short_conv.naive import activate, causal_conv1d_update, check_conv_inputs, conv_weight

__all__ = ["causal_conv1d", "causal_conv1d_update"]


def _valid_conv(buf_LC: torch.Tensor, w_CW: torch.Tensor, out_len: int) -> torch.Tensor:
    """out[..., i, :] = sum_j w[:, j] * buf[..., i + j, :] for i < out_len (the valid depthwise convolution along dim -2)."""
    w_WC = w_CW.t().contiguous()  # each tap's C weights contiguous: a strided operand makes the multiply-adds ~10x slower
    out = buf_LC[..., :out_len, :] * w_WC[0]
    for j in range(1, w_WC.shape[0]):
        out.addcmul_(buf_LC[..., j : j + out_len, :], w_WC[j])
    return out


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns y [B, T, C] in x.dtype and final_state [N, C, W-1] (in initial_state's dtype if given, else x's)."""
    C = x.shape[-1]
    w = conv_weight(weight, C)
    W = w.shape[1]
    N = check_conv_inputs(x, W, initial_state, cu_seqlens)
    activate(x.new_zeros(()), activation)
    B, T, _ = x.shape
    state_dtype = x.dtype if initial_state is None else initial_state.dtype
    if T == 0:  # nothing to convolve (F.conv1d rejects inputs shorter than the kernel); the state passes through
        state = x.new_zeros(N, C, W - 1) if initial_state is None else initial_state
        return x.clone(), state.to(state_dtype, copy=True)
    x32 = x.float()
    if cu_seqlens is None:
        state = x32.new_zeros(B, W - 1, C) if initial_state is None else initial_state.float().transpose(1, 2)
        buf = torch.cat((state, x32), dim=1)  # [B, W-1+T, C]
        y = _valid_conv(buf, w, T)  # [B, T, C]
        final = buf[:, T:].transpose(1, 2)
        return activate(y, activation).to(x.dtype), final.to(state_dtype).contiguous()

    cu = cu_seqlens.to(device=x.device, dtype=torch.long)
    lengths = cu[1:] - cu[:-1]
    seq_id = torch.repeat_interleave(torch.arange(N, device=x.device), lengths, output_size=T)
    tok_pos = torch.arange(T, device=x.device) + (seq_id + 1) * (W - 1)  # buffer slot of each token
    slots = torch.arange(W - 1, device=x.device)
    state_pos = (cu[:-1] + torch.arange(N, device=x.device) * (W - 1))[:, None] + slots  # [N, W-1]
    length = T + N * (W - 1)
    buf = x32.new_zeros(length, C)
    buf.index_copy_(0, tok_pos, x32[0])
    if initial_state is not None:
        buf[state_pos] = initial_state.float().transpose(1, 2)
    conv = _valid_conv(buf, w, length - (W - 1))  # row i ends at buffer slot i + W-1
    y = conv.index_select(0, tok_pos - (W - 1))[None]
    final = buf[state_pos + lengths[:, None]].transpose(1, 2)  # the W-1 slots ending at each sequence's last token
    return activate(y, activation).to(x.dtype), final.to(state_dtype).contiguous()
