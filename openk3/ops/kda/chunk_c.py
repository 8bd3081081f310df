"""KDA prefill in chunkwise form on CPU in two C calls and one bmm: the "c" backend's "fast" and "mixed" forms of
"kda_prefill" (ops/registry.py).

Legend as in chunk.py: B batch, T tokens, H heads, K key dim, V value dim, N sequences, C chunk size, Q chunk slots, M = Q * H.

Why: chunk.py's torch form spends most of its time outside its matmuls: layout copies of q, k, v, g into chunk-major buffers
and some twenty element-wise passes (decay exponentials, factor rows and columns, masks, diagonal-block copies) over
[M, C, K] tensors several times the size of L2, each a separate op. ops/cpu/kda_chunk.c computes the same quantities per
(slot, head) while that slot's rows are in cache, reading the token-major inputs in place: Qd, [exp(G) k | v], the state
update's factors, Aqk and the inverse T. W | U = T [exp(G) k | v] is one bmm. The state loop and the read-out
O = Qd S + Aqk V' run in a second C call, each (sequence, head) through its chunks with its state in cache, writing o in its
token-major layout: chunk.py's loop is 3 torch ops per chunk step, each a thread barrier, which a loaded machine turns into
waits for a descheduled thread (measured 10x the quiet time at load 8 on 2 cores); here the whole prefill is 3 parallel
regions.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from openk3.ops.cpu import require_inference
from openk3.ops.cpu.build import kernel
from openk3.ops.kda.chunk_layout import ChunkLayout
from openk3.ops.kda.mixed import kda_mixed
from openk3.ops.kda.naive import check_kda_inputs

MAX_CHUNK = 256  # the kernel's bound on C (kda_chunk.c)
# 32 measured 1.15x faster than 64 at T=4096, dk=dv=128 (CPU time, 1 thread; benchmarks/results/ops_kda.md): the intra-chunk
# work grows with C and the C state loop has no per-chunk dispatch to amortise
DEFAULT_CHUNK = 32


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """The ctypes functions (prep, scan), built and loaded once per process (the "c" backend's entries only)."""
    i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    prep = [i64, i64, i64, i64, i64, ptr, ptr, f32, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i32]
    scan = [i64, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i32]
    return kernel("kda_chunk.c", "openk3_kda_chunk_prep", prep, i32), kernel("kda_chunk.c", "openk3_kda_chunk_scan", scan, i32)


def slot_spans(layout: ChunkLayout, B: int, T: int, cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(first token, token count) of each chunk slot, int64 [Q]: tokens counted in the flat [B * T] order of the inputs."""
    C = layout.chunk_size
    if cu_seqlens is None:  # slot j * B + b: batch row b, tokens j*C ..
        j = torch.arange(layout.num_steps).repeat_interleave(B)
        b = torch.arange(B).repeat(layout.num_steps)
        return (b * T + j * C).contiguous(), (T - j * C).clamp(0, C).contiguous()
    if layout.rank_N is None:
        raise AssertionError("slot_spans: a packed layout without ranks")
    cu = cu_seqlens.to(torch.long).cpu()
    lengths = cu[1:] - cu[:-1]
    chunks = torch.clamp_min((lengths + C - 1) // C, 1)
    seq = torch.repeat_interleave(torch.arange(lengths.numel()), chunks)
    first_of_seq = torch.repeat_interleave(torch.cumsum(chunks, 0) - chunks, chunks)
    j = torch.arange(seq.numel()) - first_of_seq
    slot = torch.tensor(layout.offsets[:-1], dtype=torch.long)[j] + layout.rank_N[seq]
    src = torch.empty(layout.num_slots, dtype=torch.long)
    count = torch.empty(layout.num_slots, dtype=torch.long)
    src[slot] = cu[seq] + j * C
    count[slot] = (lengths[seq] - j * C).clamp(0, C)
    return src, count


def kda_chunk_c(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns o [B, T, H, V] in v.dtype and the final state [N, H, K, V] fp32; equal to naive.kda_recurrent (and
    chunk.kda_chunk) up to fp32 rounding. CPU inference; inputs of any float dtype are read as fp32."""
    N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    if C <= 0 or C & (C - 1) or C > MAX_CHUNK:
        raise ValueError(f"kda_chunk_c: chunk_size={chunk_size} is invalid: expected a power of two up to {MAX_CHUNK}")
    q32, k32, v32, g32, b32 = (x.float().contiguous() for x in (q, k, v, g, beta))
    require_inference("kda_chunk_c", q32, k32, v32, g32, b32)
    scale = K**-0.5 if scale is None else scale
    layout = ChunkLayout.build(B, T, cu_seqlens, C)
    src, count = slot_spans(layout, B, T, cu_seqlens)
    M = layout.num_slots * H
    Qd, KV, Kd_T = q32.new_empty(M, C, K), q32.new_empty(M, C, K + V), q32.new_empty(M, K, C)
    decay, Aqk, Tm = q32.new_empty(M, K, 1), q32.new_empty(M, C, C), q32.new_empty(M, C, C)
    prep, scan = _kernels()
    threads = torch.get_num_threads()
    status = prep(
        layout.num_slots, H, C, K, V, src.data_ptr(), count.data_ptr(), scale,
        q32.data_ptr(), k32.data_ptr(), v32.data_ptr(), g32.data_ptr(), b32.data_ptr(),
        Qd.data_ptr(), KV.data_ptr(), Kd_T.data_ptr(), decay.data_ptr(), Aqk.data_ptr(), Tm.data_ptr(), threads,
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"kda_chunk_c: the prep kernel failed (status {status}: 1 refused C={C}, K={K}, V={V}; 2 out of memory)")
    WU = torch.bmm(Tm, KV)  # W | U = T [exp(G) k | v]
    init = None if initial_state is None else layout.to_ranks(initial_state.float()).reshape(N * H, K, V).contiguous()
    final = q32.new_empty(N * H, K, V)  # rank order
    o = q32.new_empty(B, T, H, V)  # every token's row is written by the slot that holds it
    active = torch.tensor(layout.active, dtype=torch.long)
    offsets = torch.tensor(layout.offsets, dtype=torch.long)
    status = scan(
        N, layout.num_steps, H, C, K, V, active.data_ptr(), offsets.data_ptr(), src.data_ptr(), count.data_ptr(),
        WU.data_ptr(), Qd.data_ptr(), Kd_T.data_ptr(), decay.data_ptr(), Aqk.data_ptr(),
        None if init is None else init.data_ptr(), final.data_ptr(), o.data_ptr(), threads,
    )  # fmt: skip
    if status != 0:
        raise RuntimeError(f"kda_chunk_c: the scan kernel failed (status {status}: out of memory)")
    S = layout.from_ranks(final.view(N, H, K, V))
    return o.to(v.dtype).contiguous(), S


def kda_mixed_c(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kda_mixed with kda_chunk_c for the multi-token sequences: the "c" backend's "mixed"."""
    return kda_mixed(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size, chunk=kda_chunk_c)
