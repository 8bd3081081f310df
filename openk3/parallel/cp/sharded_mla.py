"""Decode context parallelism: the MLA latent pages sharded over the CP ranks, token by token, and MLA on those shards.

Legend: W CP ranks, r this rank, T tokens of the step, N sequences, H heads, Dv v head dim, R latent width, NP pages,
PS tokens per (logical) page, PS / W rows per page on a rank.

Layout (interleaved, one token at a time, as vLLM's DCP with interleave size 1): position p of a sequence lives on rank
p % W, in row (p % PS) // W of page page_table[p // PS]. Every rank keeps the engine's page table and page ids (the
scheduler, the block pool and the prefix cache are unchanged and count logical pages of PS tokens); a rank's pool is
[NP, PS / W, R], so the latents of a sequence cost each rank 1/W of one process's bytes. Seen from rank r its rows of a
sequence are a plain paged sequence of ceil((L - r) / W) tokens over the same page table with pages of PS / W rows,
which is what lets the paged decode run on a rank's share unchanged. Interleaving rather than blocks of tokens: every
rank holds within one token of L / W at every length (so the decode work and the memory grow evenly, and a short
sequence is spread too), and the new token of each decode step goes to the next rank in turn.

- a new token's latent is written by the rank that owns its position only (`write_owned`);
- a decode step: each rank attends the step's query over its share (ops/mla/lse.py, the latent-space form), and the
  parts are merged exactly by their log-sum-exp after one all-gather of (out [N, H, Dv], lse [N, H]) per MLA layer;
- any other step: a sequence with one new token (a decoding request beside a prefill chunk) takes the decode form; a
  prefill chunk of a fresh sequence attends its own latents as one process does; a prefill chunk after a context splits
  like a decode step (`chunks_by_lse`): each rank attends the chunk's queries over its share of the context (every rank
  has every query: the step runs whole on each), one all-gather of (out [t, H, Dv], lse [t, H]) per MLA layer carries
  the parts, and every rank merges them with the chunk's own causal part. So no rank holds more than its share of a
  context, and the context's attention work is split over the ranks, for t x H x (Dv + 1) values per rank on the wire
  (against R per context token for gathering the context: less from a context of about t x H x (Dv + 1) / R tokens on).
- a context-parallel prefill (layers.py), whose ranks hold different queries, gathers the context's shares instead
  (`gather_context`): there the latents are what is small.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from openk3.model import K3ForCausalLM
from openk3.model.batch import ForwardBatch
from openk3.model.mla import GatedMLA, read_latents
from openk3.ops.mla import split_kv_b
from openk3.ops.mla.lse import merge_by_lse, mla_decode_paged_lse, mla_rows_lse
from openk3.parallel.group import ParallelContext


@dataclass(frozen=True)
class LatentShards:
    """Rank `rank` of `size` in the interleaved layout (module docstring)."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"LatentShards: rank={self.rank}, size={self.size}, expected 0 <= rank < size")

    def held(self, length: int) -> int:
        """Of positions 0 .. length - 1, how many this rank holds."""
        return max(0, (length - self.rank + self.size - 1) // self.size)

    def held_t(self, lengths: torch.Tensor) -> torch.Tensor:
        return torch.clamp((lengths - self.rank + self.size - 1) // self.size, min=0)

    def of(self, rank: int) -> LatentShards:
        return LatentShards(rank, self.size)


def write_owned(pool_PSR: torch.Tensor, page_table: torch.Tensor, batch: ForwardBatch, latent_TR: torch.Tensor, shards: LatentShards) -> None:
    """Scatter the step's latents this rank owns into its pool (model/mla.py's write_latents, for one share)."""
    if pool_PSR.dtype == torch.uint8:
        raise ValueError("decode context parallelism: the FP8 latent cache is not supported with it (docs/parallel.md)")
    rows = pool_PSR.shape[1]
    page_size = rows * shards.size
    seqs = torch.arange(batch.num_seqs, device=latent_TR.device)
    seq_of_token = seqs if batch.is_decode else torch.repeat_interleave(seqs, batch.seq_lens, output_size=latent_TR.shape[0])
    mine = batch.positions % shards.size == shards.rank
    pos = batch.positions[mine]
    pages = page_table[seq_of_token[mine], pos // page_size]
    pool_PSR[pages, (pos % page_size) // shards.size] = latent_TR[mine].to(pool_PSR.dtype)


def gather_context(pool_PSR: torch.Tensor, page_table: torch.Tensor, lengths: list[int], shards: LatentShards, ctx: ParallelContext) -> list[torch.Tensor]:
    """Per sequence its first lengths[i] latents [lengths[i], R] in position order, from every rank's share (one
    all-gather, padded to the largest rank's rows: rank 0 holds the most)."""
    width = sum(shards.of(0).held(n) for n in lengths)
    if width == 0:  # no context anywhere (a fresh prompt): every rank reads that from the batch alike, and sends nothing
        return [pool_PSR[:0, 0] for _ in lengths]
    mine = [read_latents(pool_PSR, page_table[i], shards.held(n)) if shards.held(n) else pool_PSR[:0, 0] for i, n in enumerate(lengths)]
    local = pool_PSR.new_zeros(width, pool_PSR.shape[-1])
    rows = torch.cat(mine) if mine else local[:0]
    local[: rows.shape[0]] = rows
    parts = ctx.all_gather(local)
    out, offsets = [], [0] * shards.size
    for n in lengths:
        seq = pool_PSR.new_empty(n, pool_PSR.shape[-1])
        for q in range(shards.size):
            k = shards.of(q).held(n)
            seq[q :: shards.size] = parts[q, offsets[q] : offsets[q] + k]
            offsets[q] += k
        out.append(seq)
    return out


def attend_over(mla: GatedMLA, q_nope_tHD: torch.Tensor, q_pe_tHR: torch.Tensor, latents_sR: torch.Tensor, q_offset: int) -> torch.Tensor:
    """One sequence's queries (at positions q_offset + j) against `latents_sR` (every latent up to its last query, in
    position order): model/mla.py's attend_prefill over given latents instead of pages. [t, H, Dv]."""
    w_uk, w_uv = split_kv_b(mla.kv_b_proj.weight, mla.num_heads, mla.nope, mla.v_dim)
    c, kpe = latents_sR.split([mla.lora, mla.rope], dim=-1)
    return mla.prefill(q_nope_tHD, q_pe_tHR, c, kpe, w_uk, w_uv, mla.scale, q_offset)


def decode_on_shards(
    mla: GatedMLA,
    q_nope_NHD: torch.Tensor,
    q_pe_NHR: torch.Tensor,
    pool_PSR: torch.Tensor,
    page_table_NP: torch.Tensor,
    kv_lens_N: torch.Tensor,
    shards: LatentShards,
    ctx: ParallelContext,
) -> torch.Tensor:
    """One query per sequence over its first kv_lens[n] latents (its own included), [N, H, Dv] fp32: this rank's part
    over its share, merged with every rank's by LSE after one all-gather of [out | lse]."""
    w_uk, w_uv = split_kv_b(mla.kv_b_proj.weight, mla.num_heads, mla.nope, mla.v_dim)
    held = shards.held_t(kv_lens_N)
    out_NHV, lse_NH = mla_decode_paged_lse(q_nope_NHD, q_pe_NHR, pool_PSR, page_table_NP, held, w_uk, w_uv, mla.scale)
    n, h, v = out_NHV.shape
    both = ctx.all_gather(torch.cat([out_NHV.reshape(n, h * v), lse_NH], dim=-1))  # one message: [W, N, H * Dv + H]
    return merge_by_lse(both[..., : h * v].reshape(-1, n, h, v), both[..., h * v :])


def chunks_by_lse(
    mla: GatedMLA,
    q_nope_THD: torch.Tensor,
    q_pe_THR: torch.Tensor,
    latent_TR: torch.Tensor,
    spans: list[tuple[int, int]],
    contexts: list[tuple[torch.Tensor, int]],
    pool_PSR: torch.Tensor,
    shards: LatentShards,
    ctx: ParallelContext,
) -> list[torch.Tensor]:
    """Per prefill chunk (its rows [lo, hi) of the step, its page-table row and context length): its queries over the
    whole context and itself, [t, H, Dv] fp32 (module docstring): this rank's part over its share of the context, every
    rank's parts after one all-gather of [out | lse] for all the chunks, merged with the chunk's own causal part (its
    latents as the pages hold them)."""
    w_uk, w_uv = split_kv_b(mla.kv_b_proj.weight, mla.num_heads, mla.nope, mla.v_dim)
    h, v = mla.num_heads, mla.v_dim
    mine = []
    for (lo, hi), (pages_P, length) in zip(spans, contexts, strict=True):
        held = shards.held(length)  # none on this rank for a context shorter than its rank: an empty part
        rows_sR = read_latents(pool_PSR, pages_P, held) if held else pool_PSR[:0, 0]
        out_tHV, lse_tH = mla_rows_lse(q_nope_THD[lo:hi], q_pe_THR[lo:hi], rows_sR, w_uk, w_uv, mla.scale)
        mine.append(torch.cat([out_tHV.reshape(hi - lo, h * v), lse_tH], dim=-1))
    parts = ctx.all_gather(torch.cat(mine))  # one message for every chunk of the step: [W, sum t, H * Dv + H]
    merged, at = [], 0
    for lo, hi in spans:
        t = hi - lo
        own_out, own_lse = mla_rows_lse(q_nope_THD[lo:hi], q_pe_THR[lo:hi], latent_TR[lo:hi].to(pool_PSR.dtype), w_uk, w_uv, mla.scale, causal=True)
        theirs = parts[:, at : at + t]
        outs = torch.cat([theirs[..., : h * v].reshape(-1, t, h, v), own_out[None]])
        lses = torch.cat([theirs[..., h * v :], own_lse[None]])
        merged.append(merge_by_lse(outs, lses))
        at += t
    return merged


class ShardedLatentMLA(nn.Module):
    """A GatedMLA whose pages hold this rank's share (module docstring); swapped in around the layer for a step."""

    def __init__(self, inner: GatedMLA, shards: LatentShards, ctx: ParallelContext) -> None:
        super().__init__()
        if ctx.world_size != shards.size:
            raise ValueError(f"ShardedLatentMLA: {shards.size} shards over a CP group of {ctx.world_size} ranks")
        self.inner, self.shards, self.ctx = inner, shards, ctx

    def forward(self, x_TD: torch.Tensor, batch: ForwardBatch, latent_pool: torch.Tensor | None) -> torch.Tensor:
        if latent_pool is None or batch.page_table is None:
            raise ValueError("decode context parallelism: a step without the cache pages (a cache-free forward) has no shards to read")
        if batch.stepwise:
            raise ValueError("decode context parallelism: stepwise (speculative) batches are not supported with it")
        inp = self.inner.project(x_TD)
        table = batch.page_table
        write_owned(latent_pool, table, batch, inp.latent_TR, self.shards)
        if batch.is_decode:
            out = decode_on_shards(self.inner, inp.q_nope, inp.q_pe, latent_pool, table, batch.context_lens + 1, self.shards, self.ctx)
            return self.inner.output(out.to(inp.q_nope.dtype), inp.gate_logits, x_TD.dtype)
        cu, ctx_lens = batch.cu_seqlens.tolist(), batch.context_lens.tolist()
        out_THV = inp.q_nope.new_empty(inp.q_nope.shape[0], self.inner.num_heads, self.inner.v_dim)
        # one new token (a decoding request beside a prefill chunk): the decode form, so no context is gathered for it
        ones = [i for i in range(batch.num_seqs) if cu[i + 1] - cu[i] == 1]
        if ones:
            rows, seqs = torch.tensor([cu[i] for i in ones], device=table.device), torch.tensor(ones, device=table.device)
            q_nope, q_pe, lens = inp.q_nope[rows], inp.q_pe[rows], batch.context_lens[seqs] + 1
            out_THV[rows] = decode_on_shards(self.inner, q_nope, q_pe, latent_pool, table[seqs], lens, self.shards, self.ctx).to(out_THV.dtype)
        chunks = [i for i in range(batch.num_seqs) if cu[i + 1] - cu[i] > 1]
        for i in chunks:
            if ctx_lens[i] == 0:  # a fresh sequence: its own latents, as the pages hold them, are its whole context
                lo, hi = cu[i], cu[i + 1]
                out_THV[lo:hi] = attend_over(self.inner, inp.q_nope[lo:hi], inp.q_pe[lo:hi], inp.latent_TR[lo:hi].to(latent_pool.dtype), 0)
        after = [i for i in chunks if ctx_lens[i] > 0]
        if after:
            spans = [(cu[i], cu[i + 1]) for i in after]
            pages = [(table[i], ctx_lens[i]) for i in after]
            merged = chunks_by_lse(self.inner, inp.q_nope, inp.q_pe, inp.latent_TR, spans, pages, latent_pool, self.shards, self.ctx)
            for (lo, hi), out in zip(spans, merged, strict=True):
                out_THV[lo:hi] = out.to(out_THV.dtype)
        return self.inner.output(out_THV, inp.gate_logits, x_TD.dtype)


@contextmanager
def sharded_mla_layers(model: K3ForCausalLM, shards: LatentShards, ctx: ParallelContext) -> Iterator[None]:
    """Every MLA layer in its sharded form for the duration of the block (the KDA layers and the rest unchanged)."""
    pairs = [(layer, layer.self_attn) for layer in model.model.layers]
    originals = [(layer, attn) for layer, attn in pairs if isinstance(attn, GatedMLA)]
    try:
        for layer, attn in originals:
            layer.self_attn = ShardedLatentMLA(attn, shards, ctx)
        yield
    finally:
        for layer, original in originals:
            layer.self_attn = original
