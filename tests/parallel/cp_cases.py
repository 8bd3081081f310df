"""Work run on each spawned rank by the context-parallel tests (module-level so spawn can import it); returns plain numbers."""

from __future__ import annotations

from dataclasses import replace

import torch

from openk3.config import debug
from openk3.model import CacheTensors, ForwardBatch, K3ForCausalLM
from openk3.model.batch import StateCut
from openk3.parallel.cp.prefill import context_parallel_prefill
from openk3.parallel.group import ParallelContext
from openk3.serve.cache.transfer import copy_slot
from tests.model.conftest import build

PAGE_SIZE = 16
SLOT = 1  # not slot 0, so that a slot mix-up shows
DECODE_STEPS = 6


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, debug().vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def new_cache(model: K3ForCausalLM, length: int) -> tuple[CacheTensors, torch.Tensor]:
    pages = -(-(length + DECODE_STEPS) // PAGE_SIZE)
    cache = CacheTensors.allocate(model.config, num_slots=3, num_pages=pages + 2, page_size=PAGE_SIZE)
    return cache, torch.arange(2, pages + 2)  # pages 0 and 1 stay unused


def greedy_decode(model: K3ForCausalLM, cache: CacheTensors, pages: torch.Tensor, first: int, context: int) -> list[int]:
    tokens = [first]
    for step in range(DECODE_STEPS):
        batch = ForwardBatch.for_step([[tokens[-1]]], [context + step], [SLOT], pages[None])
        tokens.append(int(model(batch, cache)[-1].argmax()))
    return tokens


def one_process(model: K3ForCausalLM, ids: list[int], chunks: list[tuple[int, int]]) -> tuple[torch.Tensor, CacheTensors, list[int]]:
    """Prefill in one process, chunk after chunk through the cache (one chunk: the whole prompt), then greedy decode."""
    cache, pages = new_cache(model, len(ids))
    # a one-token chunk stays a prefill step, as CP's one-token shard is (for_step would mark it a decode step)
    steps = [replace(ForwardBatch.for_step([ids[lo:hi]], [lo], [SLOT], pages[None], only_last_logits=False), is_decode=False) for lo, hi in chunks]
    logits = torch.cat([model(batch, cache) for batch in steps])
    decode_cache = CacheTensors([t.clone() for t in cache.kda_state], [t.clone() for t in cache.conv_state], [t.clone() for t in cache.mla_latent], PAGE_SIZE)
    return logits, cache, greedy_decode(model, decode_cache, pages, int(logits[-1].argmax()), len(ids))


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@torch.no_grad()
def cp_case(ctx: ParallelContext, length: int, seed: int, context: int = 0, kda_scan: bool = False) -> dict[str, float]:
    """CP prefill of a prompt of `length` tokens; with `context`, its first `context` tokens are prefilled in one process
    first (a prefix hit or an earlier chunk) and CP runs the rest; the logits compared are the rest's. `kda_scan`: the
    KDA layers by the scan (cp/kda_scan.py)."""
    model = build(debug())
    ids = prompt(length, seed)
    cache, pages = new_cache(model, length)
    if context:
        model(replace(ForwardBatch.for_step([ids[:context]], [0], [SLOT], pages[None]), is_decode=False), cache)
    out = context_parallel_prefill(model, ctx, ids[context:], cache, SLOT, pages, context_len=context, kda_scan=kda_scan)
    whole_logits, _, whole_tokens = one_process(model, ids, [(0, length)])
    whole_logits = whole_logits[context:]
    # the same rows through the same ops as CP: what CP must reproduce; the whole prompt in one step differs from
    # either by fp32 reassociation alone (matmuls over other row counts), reported as "whole_*"
    ref_logits, ref_cache, ref_tokens = one_process(model, ids, ([(0, context)] if context else []) + [(context + lo, context + hi) for lo, hi in out.shards])
    ref_logits = ref_logits[context:]
    chunked_vs_whole = float((ref_logits - whole_logits).abs().max())
    logprobs = torch.log_softmax(out.logits.float(), -1)
    ref_logprobs = torch.log_softmax(ref_logits.float(), -1)
    used = pages[: -(-length // PAGE_SIZE)]
    errors = {
        "whole_logits": float((out.logits - whole_logits).abs().max()),
        "whole_chunked_logits": chunked_vs_whole,
        "logits": float((out.logits - ref_logits).abs().max()),
        "prompt_logprobs": float((logprobs - ref_logprobs).abs().max()),
        "kda_state": max_diff(cache.kda_state, ref_cache.kda_state),
        "conv_state": max_diff(cache.conv_state, ref_cache.conv_state),
        "mla_latent": max_diff([p[used] for p in cache.mla_latent], [p[used] for p in ref_cache.mla_latent]),
        "untouched_pages": max(float(p[:2].abs().max()) for p in cache.mla_latent),
    }
    tokens = greedy_decode(model, cache, pages, int(out.logits[-1].argmax()), length)  # from the CP cache, on this rank alone
    return errors | {
        "mismatched_tokens": float(sum(a != b for a, b in zip(tokens, ref_tokens, strict=True))),
        "mismatched_whole_tokens": float(sum(a != b for a, b in zip(tokens, whole_tokens, strict=True))),
        "mla_bytes": float(sum(r.nbytes for r in out.received if r.what == "mla_latent")),
        "kda_bytes": float(sum(r.nbytes for r in out.received if r.what in ("kda_conv", "kda_state"))),
        "kda_conv_bytes": float(sum(r.nbytes for r in out.received if r.what == "kda_conv")),
        "kda_scan_bytes": float(sum(r.nbytes for r in out.received if r.what == "kda_scan")),
        "attn_modules_restored": float(all(type(layer.self_attn).__name__ in ("GatedMLA", "KimiDeltaAttention") for layer in model.model.layers)),
    }


def all_cases(ctx: ParallelContext, lengths: tuple[int, ...], context: int) -> dict[str, dict[str, float]]:
    """Keys: the prompt length, and "<length>+ctx" for the same prompt after `context` tokens prefilled in one process."""
    torch.manual_seed(0)
    out = {str(length): cp_case(ctx, length, seed=length) for length in lengths}
    return out | {f"{length}+ctx": cp_case(ctx, length, seed=length, context=context) for length in lengths if length > context + ctx.world_size}


def generate_case(ctx: ParallelContext, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """The embedded demo model's greedy tokens with the prompt prefilled over the ranks (cp_generate)."""
    from openk3.model import load_model
    from openk3.parallel.cp.generate import cp_generate
    from openk3.serve.loading import resolve_model

    path = resolve_model("tiny")
    assert path is not None
    return cp_generate(load_model(path).eval(), ctx, prompt_ids, max_tokens)


CUT_SLOTS = (0, 2, 3)  # snapshot slots of the cut cases (SLOT is the sequence's own)


@torch.no_grad()
def cut_case(ctx: ParallelContext, length: int, offsets: tuple[int, ...], context: int = 0, kda_scan: bool = False) -> dict[str, float]:
    """CP prefill of `length - context` new tokens with prefix-cache cuts after `offsets` of them (slots CUT_SLOTS);
    against one process prefilling the same shards as chunks, each with the cuts inside it as its state_cuts (a cut at a
    shard's end: the slot copied after that chunk, as the prefix cache snapshots a chunk's end). Every slot compared."""
    model = build(debug())
    ids = prompt(length, seed=length + 1)
    pages = torch.arange(2, 2 + -(-length // PAGE_SIZE))
    caches = [CacheTensors.allocate(model.config, num_slots=4, num_pages=int(pages[-1]) + 1, page_size=PAGE_SIZE) for _ in range(2)]
    if context:
        for cache in caches:
            model(replace(ForwardBatch.for_step([ids[:context]], [0], [SLOT], pages[None]), is_decode=False), cache)
    cuts = tuple(StateCut(0, o, s) for o, s in zip(offsets, CUT_SLOTS, strict=False))
    out = context_parallel_prefill(model, ctx, ids[context:], caches[0], SLOT, pages, context, cuts, kda_scan=kda_scan)
    ref = caches[1]
    for lo, hi in out.shards:
        inside = tuple(StateCut(0, c.offset - lo, c.slot) for c in cuts if lo < c.offset < hi)
        batch = ForwardBatch.for_step([ids[context + lo : context + hi]], [context + lo], [SLOT], pages[None], only_last_logits=False)
        model(replace(batch, is_decode=False, state_cuts=inside), ref)
        for c in cuts:
            if c.offset == hi:
                copy_slot(ref, SLOT, c.slot)
    return {
        "kda_state": max_diff(caches[0].kda_state, ref.kda_state),
        "conv_state": max_diff(caches[0].conv_state, ref.conv_state),
        "cut_bytes": float(sum(r.nbytes for r in out.received if r.what == "cut_state")),
        "cut_slots_filled": float(all(bool(torch.count_nonzero(p[c.slot])) for p in caches[0].kda_state for c in cuts)),
    }


def cut_cases(ctx: ParallelContext, kda_scan: bool = False) -> dict[str, dict[str, float]]:
    """Cuts inside the first and last shards and on a shard boundary, fresh and after a context."""
    w = ctx.world_size
    t = 40 - 40 % w
    boundary = t // w
    return {
        "fresh": cut_case(ctx, t, (3, boundary, t - 2), kda_scan=kda_scan),
        "context": cut_case(ctx, t + 21, (1, boundary, t - 1), context=21, kda_scan=kda_scan),
    }


def scan_cases(ctx: ParallelContext, lengths: tuple[int, ...], context: int) -> dict[str, dict[str, float]]:
    """all_cases and cut_cases with the KDA layers by the scan; the cut cases keyed "cuts:<case>"."""
    torch.manual_seed(0)
    out = {str(n): cp_case(ctx, n, seed=n, kda_scan=True) for n in lengths}
    out |= {f"{n}+ctx": cp_case(ctx, n, seed=n, context=context, kda_scan=True) for n in lengths if n > context + ctx.world_size}
    return out | {f"cuts:{case}": e for case, e in cut_cases(ctx, kda_scan=True).items()}


@torch.no_grad()
def cp_tp_case(world: ParallelContext, cp: int, tp: int, length: int) -> dict[str, float]:
    """CP prefill over cp TP groups of tp ranks (debug model, experts split by width): the logits against the whole model
    in one process, and the bytes this rank received per layer."""
    from openk3.parallel.serving.rank_groups import context_parallel_groups
    from openk3.parallel.tp.shard import parallelize_tensor

    groups = context_parallel_groups(world, cp, tp)
    model = build(debug())
    ids = prompt(length, seed=length + 2)
    whole_logits, _, _ = one_process(model, ids, [(0, length)])
    parallelize_tensor(model, groups.tp, split_experts=True)
    cache, pages = new_cache(model, length)
    out = context_parallel_prefill(model, groups.cp, ids, cache, SLOT, pages)
    received: dict[str, list[int]] = {}
    for r in out.received:
        received.setdefault(r.what, []).append(r.nbytes)
    n_kda = model.config.num_hidden_layers - len(model.config.mla_layers)
    return {
        "whole_logits": float((out.logits - whole_logits).abs().max()),
        "mla_bytes_per_layer": float(max(received.get("mla_latent", [0]))),
        "kda_bytes_per_layer": (sum(received.get("kda_conv", [])) + sum(received.get("kda_state", []))) / n_kda,
    }


def scan_rounds_case(ctx: ParallelContext) -> dict[str, float]:
    """kda_scan.predecessors over gloo on random maps (rank 0's A = 0, as a rank that knows its start): the start state
    it gives this rank against the one-by-one fold, and the maps this rank received."""
    from openk3.parallel.cp.exchange import CPExchange, shard_bounds
    from openk3.parallel.cp.kda_scan import Affine, predecessors, start_of

    gen = torch.Generator().manual_seed(5)
    heads, key, value = 2, 4, 3
    maps = [
        Affine(None if r == 0 else torch.randn(heads, key, key, generator=gen) * 0.5, torch.randn(heads, key, value, generator=gen))
        for r in range(ctx.world_size)
    ]
    start = torch.randn(heads, key, value, generator=gen)
    exchange = CPExchange(ctx, shard_bounds(ctx.world_size, ctx.world_size))
    try:
        before = predecessors(maps[ctx.rank], exchange, layer=3, num_value=value)
    finally:
        exchange.finish()
    got = start if before is None else before.apply(start)
    return {
        "error": float((got - start_of(ctx.rank, maps, start)).abs().max()),
        "maps_received": float(sum(r.what == "kda_scan" for r in exchange.received)),
    }
