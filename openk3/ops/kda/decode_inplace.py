"""KDA decode with the state updated in place and read once: the serving step's fast path.

Legend: N sequences, H heads, K key dim, V value dim. q, k, g [N, H, K], v [N, H, V], beta [N, H], state [N, H, K, V] fp32
(a view of the slot pool when the step's slots are consecutive, else a gathered copy the caller writes back).

At decode the cost is moving the state, not arithmetic: H x K x V fp32 per sequence and layer (2 MB with Kimi-Linear-48B's
32 heads of 128 x 128). kda_decode (the definition's order: decay the state,
read S^T k, update, read S^T q) makes about eleven passes over it once the gather and the scatter are counted. The decay is
per key row, so k^T (D S) = (D k)^T S with D = diag(exp g), and the read-out after the update is
    o = S'^T q~ = S^T (D q~) + (k . q~) delta,   delta = beta (v - S^T (D k)),   S' = D S + k delta^T,
so one batched matmul of [D k ; D q~] against the old state gives both reads, and the update is two in-place passes:
three passes over the state, five with a gather and a scatter around them. Same numbers as kda_decode up to fp32 rounding.
"""

from __future__ import annotations

import torch

from openk3.ops.kda.decode import check_decode_inputs


def kda_decode_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Advance `state` (fp32, modified in place) by one token per sequence; returns o [N, H, V] in v.dtype."""
    if state.dtype != torch.float32:
        raise ValueError(f"kda_decode_: state must be fp32 (it is advanced in place), got {state.dtype}")
    _, _, K, _ = check_decode_inputs("kda_decode_", q, k, v, g, beta, state)
    scale = K**-0.5 if scale is None else scale
    decay = g.float().exp()  # [N, H, K]
    k32, q32 = k.float(), q.float() * scale
    reads = torch.matmul(torch.stack((decay * k32, decay * q32), dim=2), state)  # [N, H, 2, V]: S^T D k, S^T D q~
    delta = beta.float()[..., None] * (v.float() - reads[:, :, 0])
    o = reads[:, :, 1] + (k32 * q32).sum(-1, keepdim=True) * delta
    state.mul_(decay[..., None]).addcmul_(k32[..., None], delta[:, :, None, :])
    return o.to(v.dtype)
