"""Context parallelism: one prompt's prefill split over ranks by position (docs/parallel.md, "Context-parallel prefill").

- `exchange.py`: the shards and the messages (all-gather of rows, rank-to-rank hand-offs), logged per layer;
- `layers.py`: the CP forms of MLA (latents all-gathered) and KDA (conv window and state handed on in rank order);
- `prefill.py`: `context_parallel_prefill(model, ctx, tokens, cache, slot, pages)`: the logits and cache of one process;
- `generate.py`: `cp_generate` (CP prefill, greedy decode on rank 0) and its torchrun entry;
- `sharded_mla.py`: decode context parallelism (`decode_cp`): the MLA pages sharded over the ranks, token by token,
  decode over each share merged by LSE;
- `step_model.py`: `ContextParallelStep`, what the engine runs on every rank of `LLM(cp=N)` / `serve --cp N` (a long
  prefill step split over the ranks, every other step whole on each rank), prefix-cache state cuts included.
"""
