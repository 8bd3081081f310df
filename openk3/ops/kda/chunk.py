"""KDA prefill in chunkwise (WY / UT-transform) form: the same numbers as the recurrence, computed with matmuls.

Legend: B batch, T tokens, H heads, K key dim, V value dim, N sequences, C chunk size, n chunks per sequence,
s sub-chunk size, P padded tokens per sequence (n * C). Inputs as in naive.kda_recurrent: q, k [B, T, H, K], v [B, T, H, V],
g [B, T, H, K] fp32 log decay, beta [B, T, H]; internally everything is fp32 in [N, H, n, C, *].

Per chunk, with G the in-chunk cumulative log decay and S the incoming state (derivation: docs/model.md, Kimi Linear eqs 2-9):
  Akk[r, j] = sum_c k_r k_j exp(G_r - G_j) (j < r),   Aqk[r, j] = sum_c q_r k_j exp(G_r - G_j) (j <= r)
  (I + diag(beta) Akk) [W | U] = diag(beta) [exp(G) k | v]          (unit lower triangular solve)
  V' = U - W S,   O = (q exp(G)) S + Aqk V',   S <- exp(G_C) S + (exp(G_C - G) k)^T V'
The factorised form exp(G_r) exp(-G_j) overflows once the decay over a chunk passes ~88 nats (unbounded with the softplus gate), so
exp(G_r - G_j) is never split around the chunk start: off-diagonal s-blocks split it at the first row p of the query block,
exp(G_r - G_p) * exp(G_p - G_j), both factors <= 1; diagonal s-blocks take exp(G_r - G_j) directly on the masked triangle.
"""

from __future__ import annotations

import torch

from openk3.ops.kda.naive import check_kda_inputs

SUB_CHUNK = 16
# Bound on the [.., s, s, K] diagonal-block decay tensor per slab of chunks, so a long prefill does not need O(T*s*K) extra memory.
SLAB_ELEMENTS = 1 << 23


def _to_chunks(x: torch.Tensor, cu_seqlens: torch.Tensor | None, N: int, n: int, C: int) -> torch.Tensor:
    """[B, T, H, D] or [B, T, H] -> zero-padded fp32 chunk-major [n, N*H, C, D or 1], contiguous so per-chunk slices are too.

    Zero padding is a no-op for the state (k = beta = g = 0), so a padded tail leaves each sequence's final state exact."""
    x = x.float()
    if x.dim() == 3:
        x = x.unsqueeze(-1)
    B, T, H, D = x.shape
    if cu_seqlens is None:
        out = x.new_zeros(B, n * C, H, D)
        out[:, :T] = x
    else:
        seq_id, pos = _token_index(cu_seqlens, T)
        out = x.new_zeros(N, n * C, H, D)
        out[seq_id, pos] = x[0]
    return out.view(N, n, C, H, D).permute(1, 0, 3, 2, 4).reshape(n, N * H, C, D)


def _token_index(cu_seqlens: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each packed token: its sequence and its position inside that sequence."""
    cu = cu_seqlens.to(torch.long)
    lengths = cu[1:] - cu[:-1]
    seq_id = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths, output_size=T)
    pos = torch.arange(T, device=cu.device) - cu[seq_id]
    return seq_id, pos


def _intra_chunk(q, k, G, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, G [M, C, K] -> (Akk strictly lower, Aqk lower incl. diagonal), each [M, C, C]."""
    M, C, K = k.shape
    nb = C // s
    Akk = k.new_zeros(M, C, C)
    Aqk = k.new_zeros(M, C, C)
    tri = torch.ones(s, s, dtype=torch.bool, device=k.device).tril()
    Gb = G.view(M, nb, s, K)
    D = (Gb[:, :, :, None, :] - Gb[:, :, None, :, :]).masked_fill_(~tri[:, :, None], float("-inf")).exp_()  # [M, nb, r, j, K]
    D.mul_(k.view(M, nb, 1, s, K))
    rhs = torch.stack((k.view(M, nb, s, K), q.view(M, nb, s, K)), dim=-1)  # [M, nb, r, K, 2]
    diag = torch.matmul(D, rhs)  # [M, nb, r, j, 2]
    strict = tri.logical_and(~torch.eye(s, dtype=torch.bool, device=k.device))
    for b in range(nb):
        lo, hi = b * s, (b + 1) * s
        Akk[:, lo:hi, lo:hi] = diag[:, b, :, :, 0] * strict
        Aqk[:, lo:hi, lo:hi] = diag[:, b, :, :, 1] * tri
    for b in range(1, nb):
        p, hi = b * s, (b + 1) * s
        Gp = G[:, p : p + 1]
        row_decay = (G[:, p:hi] - Gp).exp()  # exp(G_r - G_p) <= 1
        cols = k[:, :p] * (Gp - G[:, :p]).exp()  # k_j exp(G_p - G_j), each factor <= 1
        rows = torch.cat((k[:, p:hi] * row_decay, q[:, p:hi] * row_decay), dim=1)  # [M, 2s, K]
        block = torch.matmul(rows, cols.transpose(1, 2))  # [M, 2s, p]
        Akk[:, p:hi, :p] = block[:, :s]
        Aqk[:, p:hi, :p] = block[:, s:]
    return Akk, Aqk


def kda_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns o [B, T, H, V] in v.dtype and the final state [N, H, K, V] fp32; equal to naive.kda_recurrent up to fp32 rounding."""
    N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if chunk_size <= 0:
        raise ValueError(f"kda_chunk: chunk_size={chunk_size} is invalid: expected a positive int")
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    s = SUB_CHUNK if C % SUB_CHUNK == 0 else C
    scale = K**-0.5 if scale is None else scale
    longest = T if cu_seqlens is None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    n = max(1, -(-longest // C))
    P = n * C
    # Chunk-major [n, N*H, C, *] so every per-chunk slice below is contiguous.
    qc, kc, vc, gc, bc = (_to_chunks(x, cu_seqlens, N, n, C) for x in (q, k, v, g, beta))
    M = N * H
    qc.mul_(scale)

    # Everything that does not depend on the incoming state, batched over (chunks, N, H) in slabs of chunks.
    G = gc.cumsum_(dim=2)
    Aqk = qc.new_empty(n, M, C, C)
    QW = qc.new_empty(n, M, 2 * C, K)  # rows [q exp(G); W]: one matmul with S gives both read-out and W S
    U = vc.new_empty(n, M, C, V)
    KdT = kc.new_empty(n, M, K, C)  # (exp(G_C - G) k)^T
    slab = max(1, SLAB_ELEMENTS // (M * C * s * K))
    for c0 in range(0, n, slab):
        c1 = min(n, c0 + slab)
        qs, ks, vs, Gs, bs = (x[c0:c1].reshape(-1, C, x.shape[-1]) for x in (qc, kc, vc, G, bc))
        Akk, Aqk_s = _intra_chunk(qs, ks, Gs, s)
        eG = Gs.exp()
        rhs = torch.cat((ks * eG, vs), dim=-1).mul_(bs)
        WU = torch.linalg.solve_triangular(Akk.mul_(bs), rhs, upper=False, unitriangular=True)
        Aqk[c0:c1] = Aqk_s.view(c1 - c0, M, C, C)
        QW[c0:c1, :, :C] = (qs * eG).view(c1 - c0, M, C, K)
        QW[c0:c1, :, C:] = WU[..., :K].view(c1 - c0, M, C, K)
        U[c0:c1] = WU[..., K:].view(c1 - c0, M, C, V)
        KdT[c0:c1] = (ks * (Gs[:, -1:] - Gs).exp()).transpose(1, 2).reshape(c1 - c0, M, K, C)
    decay = G[:, :, -1, :, None].exp()  # [n, M, K, 1]

    S = qc.new_zeros(M, K, V) if initial_state is None else initial_state.float().reshape(M, K, V).clone()
    O = vc.new_empty(n, M, C, V)
    for i in range(n):
        QS_WS = torch.bmm(QW[i], S)
        Vp = U[i] - QS_WS[:, C:]
        torch.baddbmm(QS_WS[:, :C], Aqk[i], Vp, out=O[i])
        S = torch.baddbmm(S * decay[i], KdT[i], Vp)
    S = S.view(N, H, K, V)

    O = O.view(n, N, H, C, V).permute(1, 0, 3, 2, 4).reshape(N, P, H, V)
    if cu_seqlens is None:
        o = O[:, :T]
    else:
        seq_id, pos = _token_index(cu_seqlens, T)
        o = O[seq_id, pos].unsqueeze(0)
    return o.to(v.dtype), S
