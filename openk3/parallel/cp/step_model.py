"""ContextParallelStep: a context-parallel rank's model as the serving engine's driver runs it (`LLM(cp=N)`, `openk3 serve
--cp N`).

Every rank holds the whole model and cache pools of rank 0's shapes, and every rank runs every step the driver broadcasts
(serving/driver.py: the same batch, the prefix cache's copies replayed), so all pools hold the same contents. A step that
is one sequence's prefill of at least `min_tokens` new tokens runs context-parallel (prefill.py: each rank computes its
contiguous shard of the step, MLA latents all-gathered, the KDA state handed rank to rank -- or with `kda_scan` every
rank's recurrence at once and their state maps scanned; afterwards every rank's pools hold the whole step, as after an
ordinary forward); any other step -- decode, several sequences, a short chunk, images -- runs whole on every rank (the
same result everywhere; the workers' logits are dropped). The decision reads only the batch, which every rank received
alike, so the ranks always take the same path. What this buys: a long prompt's chunks
(the engine's chunked prefill: one chunk per step up to max_num_batched_tokens) are split W ways; decode does not get
faster.

With `decode_cp` (decode context parallelism, sharded_mla.py) every rank's MLA pages hold only its interleaved share of
the latents (pools of page_size / W rows per page, the engine's page table unchanged), in every step: a split step
writes the owned rows of the gathered latents, any other step runs with the MLA layers in their sharded form (a decode
step attends each share and merges the parts by LSE; a prefill after a context gathers the context's shares).

With prefix caching the step's KDA state cuts (the prefix cache's snapshots inside a prompt, ForwardBatch.state_cuts)
go with it: the rank whose shard holds a cut takes it and every rank gets a copy (prefill.py), so the snapshot slots hold
what a one-process step would leave there; the prefix cache's copies outside steps are replayed on every rank by the
driver, as for TP. Not taken context-parallel, by rule: a capturable (graph) batch, a stepwise (speculative) batch, a
batch with image embeddings.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from openk3.config import ModelConfig
from openk3.model import CacheTensors, ForwardBatch, K3ForCausalLM
from openk3.parallel.cp.prefill import context_parallel_prefill
from openk3.parallel.cp.sharded_mla import LatentShards, sharded_mla_layers
from openk3.parallel.group import ParallelContext


class ContextParallelStep:
    def __init__(self, model: K3ForCausalLM, ctx: ParallelContext, min_tokens: int, decode_cp: bool = False, kda_scan: bool = False) -> None:
        if min_tokens < ctx.world_size:
            raise ValueError(f"context parallel: min_tokens={min_tokens} must be at least the {ctx.world_size} ranks (every rank needs a token)")
        self.model, self.ctx, self.min_tokens, self.kda_scan = model, ctx, min_tokens, kda_scan
        self.shards = LatentShards(ctx.rank, ctx.world_size) if decode_cp else None
        self.config: ModelConfig = model.config
        self.cp_steps = 0  # steps run context-parallel (the others ran whole on every rank)
        self.cp_tokens = 0
        self.cp_cuts = 0  # prefix-cache snapshots taken inside split steps

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        return self.model.parameters(recurse)

    def splits(self, batch: ForwardBatch, cache: CacheTensors | None) -> bool:
        """Whether this step runs context-parallel (module docstring): read from the batch alone, alike on every rank."""
        simple = not (batch.is_decode or batch.capturable or batch.stepwise or batch.mm_embeds is not None)
        return cache is not None and simple and batch.num_seqs == 1 and batch.input_ids.numel() >= self.min_tokens

    def __call__(self, batch: ForwardBatch, cache: CacheTensors | None) -> torch.Tensor:
        if not self.splits(batch, cache):
            if self.shards is None or cache is None:
                return self.model(batch, cache)
            with sharded_mla_layers(self.model, self.shards, self.ctx):
                return self.model(batch, cache)
        assert cache is not None and batch.state_slots is not None and batch.page_table is not None  # splits() checked the cache
        tokens = batch.input_ids.tolist()
        slot, context_len = int(batch.state_slots[0]), int(batch.context_lens[0])
        out = context_parallel_prefill(
            self.model, self.ctx, tokens, cache, slot, batch.page_table[0], context_len, batch.state_cuts, self.shards, kda_scan=self.kda_scan
        )
        self.cp_steps += 1
        self.cp_tokens += len(tokens)
        self.cp_cuts += len(batch.state_cuts)
        return out.logits if batch.logits_indices is None else out.logits[batch.logits_indices]
