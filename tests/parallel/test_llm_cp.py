"""LLM(..., cp=N): the serving engine with context-parallel prefill (parallel/cp/step_model.py). A long prompt's prefill
chunks run split by position over the ranks, everything else whole on every rank; greedy and seeded tokens equal one
process, prompt logprobs to fp32 reassociation (CP computes a chunk in sub-chunks), and the steps that were split are the
ones the rule names."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from openk3.llm import LLM
from openk3.parallel.config import ParallelConfig
from openk3.parallel.cp.step_model import ContextParallelStep
from openk3.serve.sampling import SamplingParams

PROMPTS = [[random.Random(i).randrange(1000) for _ in range(n)] for i, n in enumerate((300, 97, 40, 9))]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
SCORED = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
ENGINE: dict[str, Any] = dict(max_num_batched_tokens=128, max_model_len=512)  # 128-token chunks: the 300-token prompt takes three steps


def cp_step(llm: LLM) -> ContextParallelStep | None:
    """The context-parallel step model rank 0's driver runs, or None for a one-process engine."""
    step = getattr(llm.engine.model, "model", None)
    return step if isinstance(step, ContextParallelStep) else None


def run(llm: LLM) -> dict[str, Any]:
    try:
        out: dict[str, Any] = {
            "batched": [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)],  # steps of several sequences: whole
            "seeded": [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, SEEDED)],
            "alone": [list(llm.generate([p], GREEDY)[0].outputs[0].token_ids) for p in PROMPTS],
        }
        step = cp_step(llm)
        before = step.cp_steps if step is not None else 0
        scored = llm.generate([PROMPTS[0]], SCORED)[0].prompt_logprobs
        assert scored is not None
        out["prompt_logprobs"] = [d.logprob for d in scored if d is not None]
        if step is not None:
            out["scored_cp_steps"] = step.cp_steps - before
        return out
    finally:
        llm.close()


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    torch.set_num_threads(1)
    return run(LLM("tiny", **ENGINE))


@pytest.mark.distributed
@pytest.mark.parametrize(("cp", "tp", "ep"), [(2, 1, 1), (3, 1, 1), (2, 2, 1), (2, 1, 2), (2, 2, 4)])
def test_llm_cp_tokens_equal_one_process(one_process: dict[str, Any], cp: int, tp: int, ep: int) -> None:
    """cp x tp ranks: with tp = 2 each CP rank is a TP group of two (4 gloo ranks), each TP shard exchanging its latents
    and KDA states with the ranks that hold the same shard; with ep = cp x tp the experts are spread over every rank,
    each TP group dispatching its own tokens (MoonEP, the default method)."""
    torch.set_num_threads(1)
    got = run(LLM("tiny", cp=cp, tp=tp, ep=ep, cp_min_tokens=32, **ENGINE))
    for key in ("batched", "seeded", "alone"):
        assert got[key] == one_process[key], key
    assert got["scored_cp_steps"] == 3, "300 prompt tokens in 128-token chunks: 128, 128 and 44 new tokens, each >= 32"
    assert len(got["prompt_logprobs"]) == len(PROMPTS[0]) - 1
    assert got["prompt_logprobs"] == pytest.approx(one_process["prompt_logprobs"], abs=1e-4)


def test_the_split_rule_reads_the_batch_alone() -> None:
    from openk3.model import CacheTensors, ForwardBatch
    from openk3.parallel.group import ParallelContext

    ctx = ParallelContext.single(torch.device("cpu"))
    fake = type("Fake", (), {"config": None})()
    step = ContextParallelStep(fake, ctx, min_tokens=4)  # type: ignore[arg-type]  # splits() reads only the batch
    cache = object.__new__(CacheTensors)
    pages = torch.zeros(1, 2, dtype=torch.int64)
    prefill = ForwardBatch.for_step([[1, 2, 3, 4, 5]], [0], [0], pages)
    assert step.splits(prefill, cache)
    assert not step.splits(prefill, None), "a cache-free forward"
    assert not step.splits(ForwardBatch.for_step([[1, 2, 3]], [0], [0], pages), cache), "fewer than min_tokens"
    two = ForwardBatch.for_step([[1, 2, 3, 4, 5], [6, 7, 8, 9]], [0, 0], [0, 1], torch.zeros(2, 2, dtype=torch.int64))
    assert not step.splits(two, cache), "two sequences"
    assert not step.splits(ForwardBatch.for_step([[1]], [7], [0], pages), cache), "decode"
    with pytest.raises(ValueError, match="at least the 1 ranks"):
        ContextParallelStep(fake, ctx, min_tokens=0)  # type: ignore[arg-type]


def test_layouts_cp_does_not_run_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"cp=2 with tp=2, ep=2, dp=1: .*spread over all 4 ranks \(ep=4\)"):
        ParallelConfig(cp=2, tp=2, ep=2)
    with pytest.raises(ValueError, match="with --dp it is not built"):
        ParallelConfig(cp=2, dp=2, ep=2)
    assert ParallelConfig(cp=2, tp=2).world_size == 4 and ParallelConfig(cp=2, tp=2, ep=4).world_size == 4
    with pytest.raises(ValueError, match="cp_min_tokens=1 is less than cp=2"):
        ParallelConfig(cp=2, cp_min_tokens=1)
    assert ParallelConfig(cp=3).world_size == 3
