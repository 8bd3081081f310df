"""Work run on each spawned rank by the tensor-parallel tests (module-level so spawn can import it); returns plain numbers."""

from __future__ import annotations

import dataclasses

import torch

from openk3.config import debug, tiny
from openk3.model import CacheTensors, ForwardBatch, K3ForCausalLM
from openk3.parallel.group import ParallelContext
from openk3.parallel.tp.shard import parallelize_tensor


def model_of(name: str) -> K3ForCausalLM:
    """A seeded fp32 model: "debug", "tied" (debug with the LM head tied to the embedding), "packed" (tiny with MXFP4
    experts, which a width split cuts by whole scale blocks)."""
    config = tiny() if name == "packed" else debug()
    if name == "tied":
        config = dataclasses.replace(config, tie_word_embeddings=True)
    model = K3ForCausalLM(config)
    model.init_weights(3)
    if name == "packed":
        model.quantize_experts()
    return model.eval()


PAGES = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])


def cached_logits(model: K3ForCausalLM, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Prefill of two sequences into fresh cache pools (the first in two chunks), then `steps` greedy decode steps: the
    last-token logits of every step. The pools are sized from model.config, as an engine sizes them."""
    cache = CacheTensors.allocate(model.config, num_slots=2, num_pages=8, page_size=16)
    rows = ids.tolist()
    logits = [model(ForwardBatch.for_step([rows[0][:5]], [0], [0], PAGES[:1]), cache)]
    logits.append(model(ForwardBatch.for_step([rows[0][5:], rows[1]], [5, 0], [0, 1], PAGES), cache))
    lengths = [len(rows[0]), len(rows[1])]
    for _ in range(steps):
        nxt = logits[-1].argmax(-1).tolist()
        logits.append(model(ForwardBatch.for_step([[t] for t in nxt], lengths, [0, 1], PAGES), cache))
        lengths = [n + 1 for n in lengths]
    return logits


def forward_difference(ctx: ParallelContext, name: str, split_experts: bool) -> dict[str, float]:
    """Max |logit difference| between the whole model and this rank's TP shard: cache-free, and through the cache pools
    (prefill, then decode steps that read the rank's own KDA state slots and latent pages)."""
    torch.manual_seed(0)
    model = model_of(name)
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want_tokens, want_steps = model.forward_tokens(ids), cached_logits(model, ids, 3)
        parallelize_tensor(model, ctx, split_experts=split_experts)
        got_tokens, got_steps = model.forward_tokens(ids), cached_logits(model, ids, 3)
    return {
        "tokens": (want_tokens - got_tokens).abs().max().item(),
        "cached": max((a - b).abs().max().item() for a, b in zip(want_steps, got_steps, strict=True)),
        "kda_heads": float(model.config.kda.num_heads),
    }
