"""Where each token of a packed (varlen) KDA prefill sits in the chunk-major buffers of kda_chunk, without padding every
sequence to the longest one.

Legend: N sequences, H heads, C chunk size, T packed tokens, D feature width, n_i chunks of sequence i, n = max n_i,
a_j sequences that have a chunk j, Q = sum_i n_i chunk slots in all.

Sequences are ranked by chunk count, longest first (stable), so the sequences still running at chunk step j are always ranks
0 .. a_j - 1: step j's chunk slots are one contiguous block [off_j, off_j + a_j), and the state of rank r < a_{j+1} carries to
slot off_{j+1} + r. A serving step that packs one 2k-token prompt with thirty 1-token continuations then costs 32 + 30 chunks
instead of 31 x 32 (what padding to the longest would do). Every sequence has at least one chunk, so a 0-token sequence passes
its state through a zero chunk unchanged (k = beta = g = 0 there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ChunkLayout:
    chunk_size: int
    num_seqs: int
    active: tuple[int, ...]  # a_j for j in 0..n-1 (non-increasing)
    offsets: tuple[int, ...]  # off_j: first slot of chunk step j; offsets[n] = Q
    row_T: torch.Tensor | None  # [T] row of each packed token in the [Q * C] chunk rows: slot * C + row in chunk (None:
    # equal-length batch, plain reshape)
    rank_N: torch.Tensor | None  # [N] rank of each sequence in the longest-first order

    @property
    def num_slots(self) -> int:
        return self.offsets[-1]

    @property
    def num_steps(self) -> int:
        return len(self.active)

    @staticmethod
    def build(B: int, T: int, cu_seqlens: torch.Tensor | None, chunk_size: int) -> ChunkLayout:
        C = chunk_size
        if cu_seqlens is None:  # B sequences of T tokens: chunk step j holds slots j*B .. j*B + B - 1, ranks = batch rows
            n = max(1, -(-T // C))
            return ChunkLayout(C, B, (B,) * n, tuple(j * B for j in range(n + 1)), None, None)
        cu = cu_seqlens.to(torch.long)
        lengths = cu[1:] - cu[:-1]
        chunks_N = torch.clamp_min((lengths + C - 1) // C, 1)
        order = torch.sort(chunks_N, descending=True, stable=True).indices
        rank_N = torch.empty_like(order)
        rank_N[order] = torch.arange(order.numel(), device=order.device)
        counts = chunks_N.tolist()
        n = max(counts)
        active = [sum(1 for c in counts if c > j) for j in range(n)]
        offsets = [0]
        for a in active:
            offsets.append(offsets[-1] + a)
        seq_T = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths, output_size=T)
        pos_T = torch.arange(T, device=cu.device) - cu[seq_T]
        offsets_t = torch.tensor(offsets, dtype=torch.long, device=cu.device)
        slot_T = offsets_t[pos_T // C] + rank_N[seq_T]
        return ChunkLayout(C, lengths.numel(), tuple(active), tuple(offsets), slot_T * C + pos_T % C, rank_N)

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H, D] or [B, T, H] -> fp32 [Q * H, C, D or 1] (slot-major, then head), zero-padded at each sequence's tail."""
        x = x.float()
        if x.dim() == 3:
            x = x.unsqueeze(-1)
        B, T, H, D = x.shape
        C, n = self.chunk_size, self.num_steps
        if self.row_T is None:
            out = x.new_zeros(n, B, H, C, D)
            full = T // C
            out[:full] = x[:, : full * C].view(B, full, C, H, D).permute(1, 0, 3, 2, 4)
            if full < n:
                out[full, :, :, : T - full * C] = x[:, full * C :].permute(0, 2, 1, 3)
            return out.view(n * B * H, C, D)
        # row copies (index_copy_), several times faster on CPU than the equivalent two-index assignment (index_put_)
        buf = x.new_zeros(self.num_slots * C, H, D).index_copy_(0, self.row_T, x[0])
        return buf.view(self.num_slots, C, H, D).permute(0, 2, 1, 3).contiguous().view(self.num_slots * H, C, D)

    def from_chunks(self, O: torch.Tensor, B: int, T: int, H: int) -> torch.Tensor:
        """[Q * H, C, V] -> [B, T, H, V] (the inverse of to_chunks for real tokens; padding rows are dropped)."""
        C, V = self.chunk_size, O.shape[-1]
        O = O.view(self.num_slots, H, C, V)
        if self.row_T is None:
            n = self.num_steps
            return O.view(n, B, H, C, V).permute(1, 0, 3, 2, 4).reshape(B, n * C, H, V)[:, :T]
        return O.transpose(1, 2).reshape(self.num_slots * C, H, V).index_select(0, self.row_T).unsqueeze(0)

    def to_ranks(self, state_NHKV: torch.Tensor) -> torch.Tensor:
        """Per-sequence tensors [N, ...] in rank order (identity for equal-length batches)."""
        if self.rank_N is None:
            return state_NHKV
        out = torch.empty_like(state_NHKV)
        out[self.rank_N] = state_NHKV
        return out

    def from_ranks(self, ranked: torch.Tensor) -> torch.Tensor:
        return ranked if self.rank_N is None else ranked[self.rank_N]
