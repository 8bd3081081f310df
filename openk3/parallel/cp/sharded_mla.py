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
- any other step (a prefill chunk, a batch mixing prefill and decode rows): each rank's share of the context before the
  step is all-gathered and put back in position order (`gather_context`, a temporary the size of that context), then the
  step attends as one process does. The cache stays sharded; the gather is the price of a prefill after a context.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from openk3.model import K3ForCausalLM
from openk3.model.batch import ForwardBatch
from openk3.model.mla import GatedMLA, MLAInputs, read_latents
from openk3.ops.mla import split_kv_b
from openk3.ops.mla.lse import merge_by_lse, mla_decode_paged_lse
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


def attend_over(mla: GatedMLA, inp: MLAInputs, batch: ForwardBatch, latents: list[torch.Tensor]) -> torch.Tensor:
    """Per sequence its queries (at positions context_lens[i] + j) against `latents[i]` (every latent up to its last
    query, in position order): model/mla.py's attend_prefill over given latents instead of pages. [T, H, Dv]."""
    w_uk, w_uv = split_kv_b(mla.kv_b_proj.weight, mla.num_heads, mla.nope, mla.v_dim)
    cu, ctx = batch.cu_seqlens.tolist(), batch.context_lens.tolist()
    outs = []
    for i, lat in enumerate(latents):
        lo, hi = cu[i], cu[i + 1]
        c, kpe = lat.split([mla.lora, mla.rope], dim=-1)
        outs.append(mla.prefill(inp.q_nope[lo:hi], inp.q_pe[lo:hi], c, kpe, w_uk, w_uv, mla.scale, ctx[i]))
    return torch.cat(outs, dim=0)


def decode_on_shards(mla: GatedMLA, inp: MLAInputs, batch: ForwardBatch, pool_PSR: torch.Tensor, shards: LatentShards, ctx: ParallelContext) -> torch.Tensor:
    """A decode step's attention [N, H, Dv] (fp32): this rank's part over its share, merged with every rank's by LSE."""
    assert batch.page_table is not None
    w_uk, w_uv = split_kv_b(mla.kv_b_proj.weight, mla.num_heads, mla.nope, mla.v_dim)
    held = shards.held_t(batch.context_lens + 1)
    out_NHV, lse_NH = mla_decode_paged_lse(inp.q_nope, inp.q_pe, pool_PSR, batch.page_table, held, w_uk, w_uv, mla.scale)
    n, h, v = out_NHV.shape
    both = ctx.all_gather(torch.cat([out_NHV.reshape(n, h * v), lse_NH], dim=-1))  # one message: [W, N, H * Dv + H]
    return merge_by_lse(both[..., : h * v].reshape(-1, n, h, v), both[..., h * v :])


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
        write_owned(latent_pool, batch.page_table, batch, inp.latent_TR, self.shards)
        if batch.is_decode:
            out_THV = decode_on_shards(self.inner, inp, batch, latent_pool, self.shards, self.ctx).to(inp.q_nope.dtype)
        else:
            cu, ctx_lens = batch.cu_seqlens.tolist(), batch.context_lens.tolist()
            context = gather_context(latent_pool, batch.page_table, ctx_lens, self.shards, self.ctx)
            # the new latents as the pages hold them: one process reads its whole context back from the pages
            latents = [torch.cat([c, inp.latent_TR[cu[i] : cu[i + 1]].to(c.dtype)]) for i, c in enumerate(context)]
            out_THV = attend_over(self.inner, inp, batch, latents)
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
