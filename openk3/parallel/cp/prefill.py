"""One prompt prefilled over W context-parallel ranks, with the same logits and cache contents as one process.

Legend: W ranks, T prompt tokens, V vocabulary, NP pages, PS page size.

Every rank holds the whole model and its own cache pools (the same slot and page ids on every rank). Rank r runs the
model on positions [lo_r, hi_r) of the prompt (exchange.py's shards) with the attention layers swapped for their CP forms
(layers.py), so that the rest of the stack -- AttnRes, MoE, norms, the head -- runs unchanged on its own tokens.
Afterwards every rank holds the whole cache of the prompt: the MLA pages of all T positions (each rank wrote the gathered
latents), and the KDA states and conv windows after the last token (broadcast from the last rank) and at the prefix
cache's cuts (broadcast from the rank that took each). Decode then runs on
any one rank (or on every rank in lockstep) with the ordinary model forward: it needs no CP. With `latent_shards` (decode
context parallelism, sharded_mla.py) each rank's pages hold only its share of the latents, and decode runs sharded too.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from openk3.config import LayerKind
from openk3.model import CacheTensors, ForwardBatch, K3ForCausalLM
from openk3.model.batch import StateCut
from openk3.model.kda import KimiDeltaAttention
from openk3.model.mla import GatedMLA
from openk3.parallel.cp.exchange import CPExchange, Received, shard_bounds
from openk3.parallel.cp.layers import ContextParallelKDA, ContextParallelMLA
from openk3.parallel.cp.sharded_mla import LatentShards
from openk3.parallel.group import ParallelContext


@dataclass(frozen=True)
class CPPrefill:
    logits: torch.Tensor  # [T, V] every prompt row (the last one samples the first output token), on every rank
    shards: list[tuple[int, int]]
    received: list[Received]  # this rank's received payloads, per layer
    padding_bytes: int  # bytes of padding this rank received in the equal-shape all-gathers
    wait_s: float  # this rank's time blocked waiting for the previous rank's KDA state (or conv window, with the scan)


@contextmanager
def context_parallel_layers(
    model: K3ForCausalLM,
    exchange: CPExchange,
    whole: ForwardBatch,
    cuts: tuple[StateCut, ...] = (),
    shards: LatentShards | None = None,
    kda_scan: bool = False,
) -> Iterator[None]:
    """Swap every attention layer for its CP form for the duration of the block (`cuts`: this rank's snapshot cuts,
    offsets from its shard's start; `shards`: the MLA pages hold this rank's share, sharded_mla.py; `kda_scan`: KDA by
    the scan, kda_scan.py); the original modules come back after."""
    layers = list(model.model.layers)
    originals: list[nn.Module] = [layer.self_attn for layer in layers]
    try:
        for layer, attn in zip(layers, originals, strict=True):
            if isinstance(attn, GatedMLA):
                layer.self_attn = ContextParallelMLA(attn, exchange, layer.index, whole, shards)
            elif isinstance(attn, KimiDeltaAttention):
                layer.self_attn = ContextParallelKDA(attn, exchange, layer.index, cuts, kda_scan)
            else:
                raise TypeError(f"context parallel: layer {layer.index} has attention {type(attn).__name__}, expected GatedMLA or KimiDeltaAttention")
        yield
    finally:
        for layer, attn in zip(layers, originals, strict=True):
            layer.self_attn = attn


def cut_owners(cuts: Sequence[StateCut], shards: Sequence[tuple[int, int]]) -> list[int]:
    """The rank that takes each cut (offsets from the step's start): the one whose shard holds the cut's last token,
    lo < offset <= hi, so a cut at a shard boundary is the end state of the shard before it."""
    owners = []
    for cut in cuts:
        if cut.seq != 0 or not 0 < cut.offset < shards[-1][1]:
            raise ValueError(f"context parallel: state cut {cut} is not strictly inside the step's one sequence of {shards[-1][1]} tokens")
        owners.append(next(r for r, (lo, hi) in enumerate(shards) if lo < cut.offset <= hi))
    return owners


def _share_states(model: K3ForCausalLM, exchange: CPExchange, cache: CacheTensors, slots_by_rank: dict[int, list[int]], what: str) -> None:
    """Every KDA layer's state and conv window of each listed slot, copied from the rank that computed it to every rank."""
    kinds = model.config.layer_kinds
    for src, slots in sorted(slots_by_rank.items()):
        idx = torch.tensor(slots, device=cache.kda_state[0].device)
        for layer in model.model.layers:
            if kinds[layer.index] != LayerKind.KDA:
                continue
            i = model.model.cache_index[layer.index]
            for pool in (cache.conv_state[i], cache.kda_state[i]):
                pool.index_copy_(0, idx, exchange.from_rank(pool[idx], src, layer.index, what))


@torch.no_grad()
def context_parallel_prefill(
    model: K3ForCausalLM,
    ctx: ParallelContext,
    token_ids: Sequence[int],
    cache: CacheTensors,
    slot: int,
    pages: torch.Tensor,
    context_len: int = 0,
    cuts: Sequence[StateCut] = (),
    latent_shards: LatentShards | None = None,
    kda_scan: bool = False,
) -> CPPrefill:
    """Prefill `token_ids` into state slot `slot` and pages `pages` [P] of `cache` over the ranks of `ctx`, after
    `context_len` tokens already in that slot and those pages on every rank (0: a fresh sequence; else the next chunk of
    a chunked prefill, or the rest of a prompt after a prefix hit). Every rank calls it with the same arguments and
    returns the same logits; the shards count positions from `context_len`. `cuts` (the prefix cache's snapshots inside
    the step, ForwardBatch.state_cuts of its one sequence) leave the KDA state and conv window after `offset` of the new
    tokens in slot `slot` of every rank, as a one-process step with those cuts does. `latent_shards`: the MLA pages hold this
    rank's share of the latents (decode context parallelism, sharded_mla.py; pools of page_size / W rows per page).
    `kda_scan`: the KDA layers' recurrence runs on every rank at once (kda_scan.py) instead of handing the state rank to
    rank; the same result to rounding."""
    t = len(token_ids)
    shards = shard_bounds(t, ctx.world_size)
    owners = cut_owners(cuts, shards)
    if context_len < 0:
        raise ValueError(f"context parallel: context_len={context_len}, expected >= 0")
    end = context_len + t
    if pages.dim() != 1 or pages.numel() * cache.page_size < end:
        raise ValueError(
            f"context parallel: pages must be one row of at least {-(-end // cache.page_size)} page ids for {end} tokens, got shape {tuple(pages.shape)}"
        )
    for s in (slot, *(c.slot for c in cuts)):
        if not 0 <= s < cache.num_slots:
            raise ValueError(f"context parallel: slot={s}, expected 0 <= slot < {cache.num_slots}")
    if slot in {c.slot for c in cuts} or len({c.slot for c in cuts}) < len(cuts):
        raise ValueError(f"context parallel: the state cuts' slots {[c.slot for c in cuts]} must differ from each other and from slot={slot}")
    device = pages.device
    lo, hi = shards[ctx.rank]
    ids = torch.tensor(list(token_ids), dtype=torch.int64, device=device)
    page_table = pages[None]
    batch = ForwardBatch(
        input_ids=ids[lo:hi],
        positions=torch.arange(context_len + lo, context_len + hi, device=device),
        cu_seqlens=torch.tensor([0, hi - lo], device=device),
        context_lens=torch.tensor([context_len + lo], device=device),
        state_slots=torch.tensor([slot], device=device),
        page_table=page_table,
    )
    whole = ForwardBatch(
        input_ids=ids,
        positions=torch.arange(context_len, end, device=device),
        cu_seqlens=torch.tensor([0, t], device=device),
        context_lens=torch.tensor([context_len], device=device),
    )
    exchange = CPExchange(ctx, shards, context_len)
    mine = tuple(StateCut(0, c.offset - lo, c.slot) for c, r in zip(cuts, owners, strict=True) if r == ctx.rank)
    try:
        with context_parallel_layers(model, exchange, whole, mine, latent_shards, kda_scan):
            local_logits = model(batch, cache)
    finally:
        exchange.finish()
    _share_states(model, exchange, cache, {ctx.world_size - 1: [slot]}, "final_state")
    cut_slots: dict[int, list[int]] = {}
    for cut, r in zip(cuts, owners, strict=True):
        cut_slots.setdefault(r, []).append(cut.slot)
    _share_states(model, exchange, cache, cut_slots, "cut_state")
    logits = exchange.gather_rows(local_logits, None, "logits")
    return CPPrefill(logits, shards, list(exchange.received), exchange.padding_bytes, exchange.wait_s)
