"""LLM(..., cp=N, enable_prefix_caching=True): prefix caching under context-parallel prefill. The snapshots a split step
takes inside its chunk (state_cuts) and at its end, and the prefix cache's slot and page copies (replayed on every rank
by the driver), leave every rank's pools as one process's, so later requests hit the same prefixes (the same hit counts
as one process with caching) and give the tokens of one process without caching -- with cuts inside a shard (cp=3) and on
shard boundaries (cp=2: 64-token cuts in 128-token chunks), and over TP groups (cp=2 x tp=2: 4 ranks, each TP shard's
snapshots taken and broadcast within the ranks that hold that shard)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from openk3.llm import LLM
from openk3.parallel.config import ParallelConfig
from openk3.serve.config import EngineConfig
from openk3.serve.output_types import CompletionOutput
from openk3.serve.sampling import SamplingParams
from tests.parallel.test_llm_cp import cp_step

SHARED = [random.Random(5).randrange(1000) for _ in range(200)]
TAILS = [[random.Random(10 + i).randrange(1000) for _ in range(n)] for i, n in enumerate((7, 60, 100))]
PROMPTS = [SHARED + tail for tail in TAILS]
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=0)
ENGINE: dict[str, Any] = dict(max_num_batched_tokens=128, max_model_len=512)


def sends(llm: LLM) -> list[CompletionOutput]:
    """Each prompt alone, then all again (repeats: hits at their deepest snapshot), then extended by its own output."""
    outs = [llm.generate([p], GREEDY)[0].outputs[0] for p in PROMPTS]
    first = [list(o.token_ids) for o in outs]
    outs += [llm.generate([p], GREEDY)[0].outputs[0] for p in PROMPTS]
    return outs + [llm.generate([p + t], GREEDY)[0].outputs[0] for p, t in zip(PROMPTS, first, strict=True)]


def rounds(llm: LLM) -> dict[str, Any]:
    """`sends`, then what the tests compare: tokens, sampled logprobs, prefix-cache hit tokens, CP steps and cuts."""
    try:
        outs = sends(llm)
        stats = llm.engine.stats().prefix_cache
        step = cp_step(llm)
        return {
            "tokens": [list(o.token_ids) for o in outs],
            "logprobs": [lp.logprob for o in outs for lp in o.logprobs or ()],
            "hits": None if stats is None else stats.hit_tokens,
            "cp_cuts": None if step is None else step.cp_cuts,
            "cp_steps": None if step is None else step.cp_steps,
        }
    finally:
        llm.close()


@pytest.fixture(scope="module")
def one_process() -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    return {"uncached": rounds(LLM("tiny", **ENGINE)), "cached": rounds(LLM("tiny", enable_prefix_caching=True, **ENGINE))}


@pytest.mark.distributed
@pytest.mark.parametrize(("cp", "tp"), [(2, 1), (3, 1), (2, 2)])
def test_cp_prefix_cache_hits_give_one_process_tokens(one_process: dict[str, dict[str, Any]], cp: int, tp: int) -> None:
    torch.set_num_threads(1)
    want, cached = one_process["uncached"], one_process["cached"]
    assert cached["tokens"] == want["tokens"] and cached["hits"] > 0, "the one-process oracle itself"
    got = rounds(LLM("tiny", cp=cp, tp=tp, cp_min_tokens=32, enable_prefix_caching=True, **ENGINE))
    assert got["tokens"] == want["tokens"]
    assert got["logprobs"] == pytest.approx(cached["logprobs"], abs=1e-4), "a hit restores one process's state, to fp32 reassociation"
    assert got["hits"] == cached["hits"], "the same prefixes hit as in one process"
    assert got["cp_cuts"] > 0 and got["cp_steps"] > 0, "snapshots were taken inside split steps"


def test_cp_with_device_prefix_caching_and_the_tiers_is_accepted() -> None:
    ParallelConfig(cp=2).check_engine(EngineConfig(enable_prefix_caching=True))
    ParallelConfig(cp=2).check_engine(EngineConfig(enable_prefix_caching=True, cpu_offload_bytes=1 << 20))  # test_multi_rank_tiers.py
    ParallelConfig(cp=2, tp=2).check_engine(EngineConfig(enable_prefix_caching=True, disk_offload_dir="/tmp/openk3-never-made"))
