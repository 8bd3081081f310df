"""The offline engine runs expert-parallel: every rank builds the same model, attaches the EP backend (tokens replicated,
experts sharded) and steps the same engine; the greedy tokens equal those of a single process."""

from __future__ import annotations

import pytest
import torch

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.parallel.ep.backend import attach_expert_parallel
from openk3.parallel.group import ParallelContext
from openk3.parallel.launch import run_ranks
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer

PROMPTS = [[5, 17, 99, 3, 250, 8, 41], [200, 1, 1, 7], list(range(30, 70))]


def greedy_tokens(ctx: ParallelContext | None, method: str | None) -> list[list[int]]:
    model = K3ForCausalLM(debug())
    model.init_weights(seed=3, std=0.1)
    model.eval()
    if ctx is not None and method is not None:
        attach_expert_parallel(model, ctx, method, replicated_tokens=True)
    llm = LLM(model, ByteTokenizer(256), max_num_batched_tokens=16)  # small budget: chunked prefill mixed with decode
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    return [list(o.token_ids) for o in outs]


@pytest.mark.distributed
@pytest.mark.parametrize("method", ["ep", "moonep"])
def test_engine_tokens_with_ep_equal_single_process(method: str) -> None:
    torch.set_num_threads(1)
    expected = greedy_tokens(None, None)
    per_rank = run_ranks(greedy_tokens, 2, method)
    assert per_rank[0] == expected and per_rank[1] == expected
