"""KDA decode: one token per sequence against its recurrent state (the serving step).

Legend: N sequences, H heads, K key dim, V value dim. q, k, g [N, H, K], v [N, H, V], beta [N, H], state [N, H, K, V] fp32.
Same evaluation order as the recurrence (decay, delta update, read-out); the state is read, never written: the caller owns the
slot and decides whether to commit new_state (prefix-cache snapshots rely on the old state staying intact).
"""

from __future__ import annotations

import torch


def check_decode_inputs(
    op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[int, int, int, int]:
    """Shapes shared by both decode ops; returns (N, H, K, V)."""
    if q.dim() != 3 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"{op}: q, k, g must be [N, H, K]; got q {tuple(q.shape)}, k {tuple(k.shape)}, g {tuple(g.shape)}")
    N, H, K = q.shape
    if v.dim() != 3 or v.shape[:2] != (N, H):
        raise ValueError(f"{op}: v must be [N, H, V] = [{N}, {H}, V], got {tuple(v.shape)}")
    V = v.shape[-1]
    if beta.shape != (N, H):
        raise ValueError(f"{op}: beta must be [N, H] = [{N}, {H}], got {tuple(beta.shape)}")
    if state.shape != (N, H, K, V):
        raise ValueError(f"{op}: state must be [N, H, K, V] = {[N, H, K, V]}, got {tuple(state.shape)}")
    return N, H, K, V


def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (o [N, H, V] in v.dtype, new_state [N, H, K, V] fp32)."""
    N, H, K, V = check_decode_inputs("kda_decode", q, k, v, g, beta, state)
    scale = K**-0.5 if scale is None else scale
    k32 = k.float()
    S = state.float() * g.float().exp()[..., None]
    predicted = torch.matmul(k32[:, :, None, :], S).squeeze(2)  # S^T k: [N, H, V]
    delta = beta.float()[..., None] * (v.float() - predicted)
    S = torch.addcmul(S, k32[..., None], delta[:, :, None, :])
    o = torch.matmul((q.float() * scale)[:, :, None, :], S).squeeze(2)
    return o.to(v.dtype), S
