"""KDA prefill for training: the chunkwise (WY) form written without in-place updates, so autograd can differentiate it.

Legend: B batch, T tokens, H heads, K key dim, V value dim, N sequences, C chunk size, n chunks per sequence, M = N * H.
Inputs and outputs as in openk3.ops.kda.naive.kda_recurrent (the definition; tests compare values and gradients with it).

The serving fast path (ops/kda/chunk.py) updates buffers in place for speed, which autograd rejects; training needs the
backward, so training selects this implementation by name (`kda="autograd"`, ops/registry.py). Intra-chunk pairs use
exp(G_r - G_j) computed on the masked lower triangle (never the factorised exp(G_r) exp(-G_j)), so no decay can overflow.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.ops.kda.naive import check_kda_inputs, sequence_spans


def _chunk(x: torch.Tensor, n: int, C: int) -> torch.Tensor:
    """[N, T, H, D] -> [n, N*H, C, D] fp32, zero-padded at the tail (zeros leave the state unchanged: k = beta = g = 0)."""
    N, T, H, D = x.shape
    x = F.pad(x.float(), (0, 0, 0, 0, 0, n * C - T))
    return x.view(N, n, C, H, D).permute(1, 0, 3, 2, 4).reshape(n, N * H, C, D)


def kda_chunk_autograd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns o [B, T, H, V] in v.dtype and the final state [N, H, K, V] fp32, differentiable in every input."""
    N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    scale = K**-0.5 if scale is None else scale
    spans = sequence_spans(B, T, cu_seqlens)
    longest = max(end - start for _, start, end in spans)
    n = max(1, -(-longest // C))

    def seqs(x: torch.Tensor) -> torch.Tensor:
        if cu_seqlens is None:
            return x
        return torch.stack([F.pad(x[row, s:e], (0, 0) * (x.dim() - 2) + (0, longest - (e - s))) for row, s, e in spans])

    qc, kc, vc, gc = (_chunk(seqs(x), n, C) for x in (q, k, v, g))
    bc = _chunk(seqs(beta).unsqueeze(-1), n, C)  # [n, M, C, 1]
    qc = qc * scale
    G = gc.cumsum(dim=2)
    # pairwise decays on the lower triangle only; the upper triangle is zeroed before exp so it cannot overflow
    lower_incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    lower_strict = lower_incl.tril(-1)
    diff = (G.unsqueeze(3) - G.unsqueeze(2)).masked_fill(~lower_incl[:, :, None], 0.0)  # [n, M, C, C, K]
    decay_rj = diff.exp()
    Akk = torch.einsum("nmrc,nmjc,nmrjc->nmrj", kc, kc, decay_rj) * lower_strict
    Aqk = torch.einsum("nmrc,nmjc,nmrjc->nmrj", qc, kc, decay_rj) * lower_incl
    eye = torch.eye(C, dtype=torch.float32, device=q.device)
    Tm = torch.linalg.solve_triangular(Akk * bc + eye, eye.expand_as(Akk), upper=False, unitriangular=True) * bc.transpose(-1, -2)
    eG = G.exp()
    Qd = qc * eG
    W = Tm @ (kc * eG)
    U = Tm @ vc
    Kd = kc * (G[:, :, -1:] - G).exp()
    decay = eG[:, :, -1].unsqueeze(-1)  # [n, M, K, 1]
    S = q.new_zeros(N * H, K, V, dtype=torch.float32) if initial_state is None else initial_state.float().reshape(N * H, K, V)
    outs = []
    for i in range(n):
        Vp = U[i] - W[i] @ S
        outs.append(Qd[i] @ S + Aqk[i] @ Vp)
        S = S * decay[i] + Kd[i].transpose(-1, -2) @ Vp
    O = torch.stack(outs).view(n, N, H, C, V).permute(1, 0, 3, 2, 4).reshape(N, n * C, H, V)
    if cu_seqlens is None:
        o = O[:, :T]
    else:
        o = torch.cat([O[i, : e - s] for i, (_, s, e) in enumerate(spans)]).unsqueeze(0)
    return o.to(v.dtype), S.view(N, H, K, V)
