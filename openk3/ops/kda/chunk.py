"""KDA prefill in chunkwise (WY / UT-transform) form: the same numbers as the recurrence, computed with matmuls.

Legend: B batch, T tokens, H heads, K key dim, V value dim, N sequences, C chunk size, Q chunk slots (the sum over sequences of
their chunk counts, see chunk_layout.py), s sub-chunk size, M rows of a batched op (Q * H). Inputs as in naive.kda_recurrent:
q, k [B, T, H, K], v [B, T, H, V], g [B, T, H, K] fp32 log decay, beta [B, T, H]; internally fp32, slot-major [Q * H, C, *].

Per chunk, with G the in-chunk cumulative log decay and S the incoming state (the Kimi Linear paper's chunkwise form, eqs 2-9):
  Akk[r, j] = sum_c k_r k_j exp(G_r - G_j) (j < r),   Aqk[r, j] = sum_c q_r k_j exp(G_r - G_j) (j <= r)
  (I + diag(beta) Akk) [W | U] = diag(beta) [exp(G) k | v]          (unit lower triangular solve)
  V' = U - W S,   O = (q exp(G)) S + Aqk V',   S <- exp(G_C) S + (exp(G_C - G) k)^T V'
The factorised form exp(G_r) exp(-G_j) overflows once the decay over a chunk passes ~88 nats (unbounded with the softplus gate), so
exp(G_r - G_j) is never split around the chunk start: see _intra_chunk for the split points that keep every factor finite.
Only the inter-chunk state recurrence is a Python loop (one step per chunk index); the rest is batched over chunk slots and heads.
"""

from __future__ import annotations

import torch

from openk3.ops.kda.chunk_layout import ChunkLayout
from openk3.ops.kda.inference_only import refuse_autograd
from openk3.ops.kda.naive import check_kda_inputs

# Smallest block factorised in one matmul; below it pairs go by dyadic levels (always exact, more passes).
SUB_CHUNK = 16
# exp(+-80) is still a normal fp32 number (the range ends near e^88), so a block may span 160 nats of decay: with the lower-bound gate
# (> -5 per token) that is any 32-row block.
MAX_HALF_SPAN = 80.0
# Decay factors below e^-60 (~1e-26) cannot move an fp32 sum of O(1) terms, but exp results and products in the denormal / underflow
# range take x86's slow path (~25x per element), so decay exponents are floored here.
EXP_FLOOR = -60.0
# Diagonal block size solved directly in _unit_lower_inverse (8 measured fastest of 2-16 on CPU).
INVERSE_BLOCK = 8


def _decay(log_decay: torch.Tensor) -> torch.Tensor:
    """exp of a log decay (<= 0), in place on a temporary."""
    return log_decay.clamp_min_(EXP_FLOOR).exp_()


def _dyadic_level(Akk: torch.Tensor, Aqk: torch.Tensor, q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, b: int) -> None:
    """Fill the pairs (r, j) that sit in the lower / upper half of one aligned 2b-block: exp(G_r - G_j) = exp(G_r - G_p) exp(G_p - G_j)
    with p the first row of the lower half, so both factors are <= 1 whatever the decay (exact up to the EXP_FLOOR of tiny factors)."""
    M, C, K = k.shape
    nP = C // (2 * b)
    Gv = G.view(M, nP, 2, b, K)
    Gp = Gv[:, :, 1, :1]  # [M, nP, 1, K]
    row_decay = _decay(Gv[:, :, 1] - Gp)
    cols = (k.view(M, nP, 2, b, K)[:, :, 0] * _decay(Gp - Gv[:, :, 0])).transpose(-1, -2)  # [M, nP, K, b]
    for A, x in ((Akk, k), (Aqk, q)):
        rows = x.view(M, nP, 2, b, K)[:, :, 1] * row_decay
        diag_blocks = torch.diagonal(A.view(M, nP, 2 * b, nP, 2 * b), dim1=1, dim2=3)  # [M, 2b, 2b, nP], a view into A
        diag_blocks[:, b:, :b] = torch.matmul(rows, cols).permute(0, 2, 3, 1)


def _factor_block(G: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    """The largest block size s (C, C/2, ..., SUB_CHUNK) whose offsets G_x - G_ref all lie within +-MAX_HALF_SPAN, with those offsets
    [M, C/s, s, K]; (s, None) when even SUB_CHUNK rows decay faster (strong softplus decay).

    G is non-increasing along a chunk (g <= 0), so a block spans [G_last, G_first]; its midpoint value G_ref halves the widest offset."""
    M, C, K = G.shape
    s = C
    while True:
        Gv = G.view(M, C // s, s, K)
        first, last = Gv[:, :, 0], Gv[:, :, -1]
        if (first - last).max().item() <= 2 * MAX_HALF_SPAN:
            return s, Gv - ((first + last) / 2).unsqueeze(2)
        if s <= SUB_CHUNK:
            return s, None
        s //= 2


def _intra_chunk(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, G [M, C, K] -> (Akk strictly lower, Aqk lower incl. diagonal), each [M, C, C].

    Inside blocks of s rows (_factor_block), one matmul per block uses exp(G_r - G_ref) exp(G_ref - G_j), each factor in fp32's normal
    range; pairs in different blocks go level by level (_dyadic_level). With no such block (very strong softplus decay), the dyadic
    levels continue down to single rows."""
    M, C, K = k.shape
    Akk = k.new_zeros(M, C, C)
    Aqk = k.new_zeros(M, C, C)
    s, rel = _factor_block(G)
    b = C // 2
    while b >= s:
        _dyadic_level(Akk, Aqk, q, k, G, b)
        b //= 2
    if rel is None:
        torch.diagonal(Aqk, dim1=1, dim2=2).copy_((q * k).sum(-1))
        while b >= 1:
            _dyadic_level(Akk, Aqk, q, k, G, b)
            b //= 2
        return Akk, Aqk
    nb = C // s
    row_decay = rel.exp_()
    cols = (k.view(M, nb, s, K) / row_decay).transpose(-1, -2)  # k_j exp(G_ref - G_j)
    ones = torch.ones(s, s, dtype=torch.bool, device=k.device)
    # Above the diagonal the two factors may multiply to inf (exp(G_r - G_j) with r < j); those entries are discarded, not multiplied.
    for A, x, drop in ((Akk, k, ~ones.tril(-1)), (Aqk, q, ~ones.tril())):
        diag_blocks = torch.diagonal(A.view(M, nb, s, nb, s), dim1=1, dim2=3)  # [M, s, s, nb], a view into A
        diag_blocks.copy_(torch.matmul(x.view(M, nb, s, K) * row_decay, cols).masked_fill_(drop, 0.0).permute(0, 2, 3, 1))
    return Akk, Aqk


def _unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """(I + L)^-1 for strictly lower triangular L [M, C, C] (its diagonal is not read).

    Triangular solves on 8-row diagonal blocks, then one level per doubling: [[A, 0], [X, D]]^-1 = [[A^-1, 0], [-D^-1 X A^-1, D^-1]].
    Batched small matmuls beat one batched solve_triangular over 64-row blocks on CPU, which runs matrix by matrix."""
    M, C, _ = L.shape
    s = min(INVERSE_BLOCK, C)
    nb = C // s
    eye = torch.eye(s, dtype=L.dtype, device=L.device)
    inv = L.new_zeros(M, C, C)
    blocks = torch.diagonal(L.view(M, nb, s, nb, s), dim1=1, dim2=3).permute(0, 3, 1, 2)  # [M, nb, s, s]
    block_inv = torch.linalg.solve_triangular(blocks, eye.expand(M, nb, s, s), upper=False, unitriangular=True)
    torch.diagonal(inv.view(M, nb, s, nb, s), dim1=1, dim2=3).copy_(block_inv.permute(0, 2, 3, 1))
    b = s
    while b < C:
        nP = C // (2 * b)
        Ld = torch.diagonal(L.view(M, nP, 2 * b, nP, 2 * b), dim1=1, dim2=3).permute(0, 3, 1, 2)  # [M, nP, 2b, 2b] views
        Xd = torch.diagonal(inv.view(M, nP, 2 * b, nP, 2 * b), dim1=1, dim2=3).permute(0, 3, 1, 2)
        Xd[:, :, b:, :b] = -torch.matmul(Xd[:, :, b:, b:], torch.matmul(Ld[:, :, b:, :b], Xd[:, :, :b, :b]))
        b *= 2
    return inv


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
    """Returns o [B, T, H, V] in v.dtype and the final state [N, H, K, V] fp32; equal to naive.kda_recurrent up to fp32 rounding.

    g must be a log decay (<= 0, as kda_gate returns): the overflow-free splits below rely on G falling along each chunk.
    Inference only (buffers are updated in place): kda_chunk_autograd is the form autograd runs through."""
    refuse_autograd("fast", q)
    N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    if C <= 0 or C & (C - 1):
        raise ValueError(f"kda_chunk: chunk_size={chunk_size} is invalid: expected a power of two")
    scale = K**-0.5 if scale is None else scale
    layout = ChunkLayout.build(B, T, cu_seqlens, C)
    # Slot-major [Q * H, C, *]: chunk step j is the contiguous row block of its a_j running sequences (chunk_layout.py).
    qc, kc, vc, gc, bc = (layout.to_chunks(x) for x in (q, k, v, g, beta))
    qc.mul_(scale)

    # Everything that does not depend on the incoming state, batched over all chunk slots and heads.
    G = gc.cumsum_(dim=1)
    Akk, Aqk = _intra_chunk(qc, kc, G)
    # T = (I + diag(beta) Akk)^-1 diag(beta): the explicit inverse is cheaper than a solve with K + V right-hand sides.
    Tm = _unit_lower_inverse(Akk.mul_(bc)).mul_(bc.transpose(1, 2))
    eG = G.clamp_min(EXP_FLOOR).exp_()  # what _decay does, without touching G
    Qd = qc * eG
    W = torch.bmm(Tm, kc * eG)
    U = torch.bmm(Tm, vc)
    Kd_T = _decay(G[:, -1:] - G).mul_(kc).transpose(1, 2)  # (exp(G_C - G) k)^T, [Q * H, K, C]
    S_in, Vp, final = state_scan(layout, W, U, Kd_T, eG[:, -1, :, None], initial_state, N, H)
    O = torch.bmm(Qd, S_in).baddbmm_(Aqk, Vp)
    S = layout.from_ranks(final.view(N, H, K, V))
    o = layout.from_chunks(O, B, T, H)
    return o.to(v.dtype).contiguous(), S


def state_scan(
    layout: ChunkLayout, W: torch.Tensor, U: torch.Tensor, Kd_T: torch.Tensor, decay: torch.Tensor, initial_state: torch.Tensor | None, N: int, H: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inter-chunk recurrence: V' = U - W S, S <- exp(G_C) S + (exp(G_C - G) k)^T V', one step per chunk index.

    W [Q * H, C, K], U [Q * H, C, V] (row-contiguous views allowed), Kd_T [Q * H, K, C], decay [Q * H, K, 1]. Returns each
    slot's incoming state S_in [Q * H, K, V], the pseudo-values V' [Q * H, C, V] and the final states [N * H, K, V] in rank
    order. The Python loop carries only the state (3 ops per chunk step: on a busy machine every op is a thread barrier);
    S_in keeps each chunk's incoming state so the read-out O = (q exp(G)) S + Aqk V' is two batched matmuls after the loop.
    No zero-fill: step 0's slots get the initial states below and step j writes step j+1's; each rank's row of `final` is
    written at the step its sequence ends, and V''s slots by their own step."""
    K, V = W.shape[-1], U.shape[-1]
    S_in = W.new_empty(layout.num_slots * H, K, V)
    final = W.new_empty(N * H, K, V)  # rank order
    first = S_in[: layout.active[0] * H]
    if initial_state is None:
        first.zero_()
    else:
        first.copy_(layout.to_ranks(initial_state.float()).reshape(N * H, K, V))
    Vp = W.new_empty(U.shape)  # pseudo-values V' = U - W S
    for j, running in enumerate(layout.active):
        lo, hi = layout.offsets[j] * H, (layout.offsets[j] + running) * H
        carried = (layout.active[j + 1] if j + 1 < layout.num_steps else 0) * H
        torch.baddbmm(U[lo:hi], W[lo:hi], S_in[lo:hi], alpha=-1, out=Vp[lo:hi])
        # The next state of ranks that go on lands in step j+1's slots, that of ranks ending here in `final`; when every rank
        # goes on (equal lengths, and most steps of a packed batch) it is written there directly, with no copy.
        nlo = layout.offsets[j + 1] * H if carried else 0
        if carried == hi - lo:
            nxt = S_in[nlo : nlo + carried]
        elif carried == 0:
            nxt = final[: hi - lo]
        else:
            nxt = S_in.new_empty(hi - lo, K, V)
        torch.mul(S_in[lo:hi], decay[lo:hi], out=nxt).baddbmm_(Kd_T[lo:hi], Vp[lo:hi])
        if 0 < carried < hi - lo:
            S_in[nlo : nlo + carried] = nxt[:carried]
            final[carried : hi - lo] = nxt[carried:]
    return S_in, Vp, final
