"""KDA by definition: a per-token recurrence in fp32, in the reference evaluation order.

Legend: B batch, T tokens, H heads, K key dim, V value dim, N sequences (N = B, or len(cu_seqlens) - 1 when packed, then B = 1).
q, k [B, T, H, K] (already L2-normalised), v [B, T, H, V], g [B, T, H, K] log decay, beta [B, T, H], state S [N, H, K, V] fp32.

Per token: S <- S * exp(g)[:, None]; S <- S + beta k (v - S^T k)^T; o = S^T (q * scale).
This file is the definition the fast paths are tested against, so it favours the literal formula over speed.
"""

from __future__ import annotations

import torch


def assert_cu_seqlens_on_device(cu_seqlens: torch.Tensor, tokens: int) -> None:
    """cu_seqlens runs from 0 to `tokens` without decreasing, asserted on its device: an error surfaces at the next
    synchronisation instead of a host read of the values on every call (each KDA layer of every decode step), and the
    check stays legal inside a CUDA graph capture."""
    ok = (cu_seqlens[0] == 0) & (cu_seqlens[-1] == tokens) & (cu_seqlens[1:] >= cu_seqlens[:-1]).all()
    torch._assert_async(ok, f"kda: cu_seqlens must be [N+1], non-decreasing from 0 to T={tokens}")


def check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens) -> int:
    """Validate shapes shared by every KDA prefill path; returns N, the number of sequences. The cu_seqlens values are
    read on the host for CPU tensors, and asserted on the device for others (assert_cu_seqlens_on_device)."""
    if q.dim() != 4 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"kda: q, k, g must all be [B, T, H, K]; got q {tuple(q.shape)}, k {tuple(k.shape)}, g {tuple(g.shape)}")
    B, T, H, _ = q.shape
    if v.dim() != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"kda: v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"kda: beta must be [B, T, H] = [{B}, {T}, {H}], got {tuple(beta.shape)}")
    if cu_seqlens is None:
        N = B
    else:
        if B != 1:
            raise ValueError(f"kda: with cu_seqlens the batch must be packed into B=1, got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"kda: cu_seqlens must be [N+1] with N >= 1, got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.device.type != "cpu":
            assert_cu_seqlens_on_device(cu_seqlens, T)
        elif int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T:
            raise ValueError(f"kda: cu_seqlens must be [N+1] from 0 to T={T}, got {cu_seqlens.tolist()}")
        elif bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
            raise ValueError(f"kda: cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}")
        N = cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (N, H, q.shape[-1], v.shape[-1]):
        raise ValueError(f"kda: initial_state must be [N, H, K, V] = {[N, H, q.shape[-1], v.shape[-1]]}, got {tuple(initial_state.shape)}")
    return N


def sequence_spans(B: int, T: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of each sequence, in state order."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    bounds = cu_seqlens.tolist()
    return [(0, bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns o [B, T, H, V] in v.dtype and the final state [N, H, K, V] fp32."""
    N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    q32, k32, v32, g32, b32 = (x.float() for x in (q, k, v, g, beta))
    o = torch.zeros(B, T, H, V, dtype=torch.float32, device=q.device)
    final = torch.empty(N, H, K, V, dtype=torch.float32, device=q.device)
    for n, (row, start, end) in enumerate(sequence_spans(B, T, cu_seqlens)):
        S = torch.zeros(H, K, V, dtype=torch.float32, device=q.device) if initial_state is None else initial_state[n].float().clone()
        for t in range(start, end):
            S = S * g32[row, t].exp()[:, :, None]
            k_t = k32[row, t]
            predicted = (S * k_t[:, :, None]).sum(dim=1)  # S^T k: [H, V]
            delta = b32[row, t][:, None] * (v32[row, t] - predicted)
            S = S + k_t[:, :, None] * delta[:, None, :]
            o[row, t] = (S * (q32[row, t] * scale)[:, :, None]).sum(dim=1)
        final[n] = S
    return o.to(v.dtype), final
