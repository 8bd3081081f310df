"""Greedy generation with a context-parallel prefill: the prompt prefilled over all ranks (prefill.py), then decoded on
rank 0 alone from the cache the prefill left there, the tokens broadcast so that every rank returns them.

Under torchrun (one process per rank, gloo on CPU, NCCL on CUDA):

    torchrun --nproc-per-node 2 -m openk3.parallel.cp.generate --model tiny --prompt "..." --max-tokens 16

This is the model-level path: no scheduler, one prompt, greedy. The serving engine runs it with `--cp N` (cp/step_model.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist

from openk3.model import CacheTensors, ForwardBatch, K3ForCausalLM
from openk3.parallel.cp.prefill import context_parallel_prefill
from openk3.parallel.group import ParallelContext

PAGE_SIZE = 64


@torch.no_grad()
def cp_generate(model: K3ForCausalLM, ctx: ParallelContext, prompt_ids: Sequence[int], max_tokens: int) -> list[int]:
    """`max_tokens` greedy tokens after `prompt_ids` (all ranks call it alike and return the same list)."""
    if max_tokens < 1:
        raise ValueError(f"cp_generate: max_tokens={max_tokens}, expected >= 1")
    length = len(prompt_ids)
    device = next(model.parameters()).device
    pages = torch.arange(-(-(length + max_tokens) // PAGE_SIZE), device=device)
    cache = CacheTensors.allocate(model.config, num_slots=1, num_pages=pages.numel(), page_size=PAGE_SIZE, device=device)
    out = context_parallel_prefill(model, ctx, prompt_ids, cache, 0, pages)
    tokens = [int(out.logits[-1].argmax())]
    if ctx.rank == 0:
        for step in range(max_tokens - 1):
            batch = ForwardBatch.for_step([[tokens[-1]]], [length + step], [0], pages[None])
            tokens.append(int(model(batch, cache)[-1].argmax()))
    if ctx.connected():
        assert ctx.group is not None
        shared = torch.tensor(tokens if ctx.rank == 0 else [0] * max_tokens, dtype=torch.int64, device=ctx.device)
        dist.broadcast(shared, src=dist.get_global_rank(ctx.group, 0), group=ctx.group)
        tokens = shared.tolist()
    return tokens


def main(argv: list[str] | None = None) -> int:
    from openk3.parallel.launch import init_from_env
    from openk3.serve.loading import build_model

    p = argparse.ArgumentParser(prog="python -m openk3.parallel.cp.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="preset name or checkpoint folder (default: the embedded demo model)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="weights of a preset without a checkpoint")
    a = p.parse_args(argv)
    ctx = init_from_env()
    try:
        model, tokenizer = build_model(a.model, torch.float32, ctx.device, a.seed)
        assert isinstance(model, K3ForCausalLM)
        ids = tokenizer.encode(a.prompt)
        tokens = cp_generate(model.eval(), ctx, ids, a.max_tokens)
        if ctx.rank == 0:
            print(tokenizer.decode(tokens))
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
