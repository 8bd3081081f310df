"""Context-parallel prefill equals one process: logits and prompt logprobs (fp32, 1e-5), the KDA states, conv windows and
MLA pages it leaves in the cache, and the greedy tokens decoded from that cache -- on 2 and 3 gloo ranks, for prompts
whose shards do and do not line up with the KDA chunk and the pages; the one-rank form in process; the shard rule.

The oracle is one process prefilling the same rows as the same chunks through its cache (the engine's chunked prefill):
CP must match it to 1e-5 (it is bitwise equal today). Against the whole prompt in one step, both differ by the same fp32
reassociation (matmuls over other row counts, up to ~1e-4 on these random-weight logits): CP may add nothing to it."""

from __future__ import annotations

import random

import pytest
import torch

from openk3.config import debug
from openk3.parallel.cp.exchange import shard_bounds
from openk3.parallel.cp.prefill import context_parallel_prefill
from openk3.parallel.group import ParallelContext
from openk3.parallel.launch import run_ranks
from tests.model.conftest import build
from tests.parallel.cp_cases import SLOT, all_cases, cp_case, cp_tp_case, generate_case, new_cache, prompt

LENGTHS = (5, 37, 150)
CONTEXT = 21  # tokens prefilled in one process before CP runs the rest (cases "<length>+ctx")
CASES = [str(n) for n in LENGTHS] + [f"{n}+ctx" for n in LENGTHS if n > CONTEXT + max(2, 3)]
WORLDS = (2, 3)


def test_shards_are_contiguous_in_order_and_balanced() -> None:
    assert shard_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert shard_bounds(4, 2) == [(0, 2), (2, 4)]
    with pytest.raises(ValueError, match="at least one token per rank"):
        shard_bounds(2, 3)


def test_one_rank_is_the_plain_prefill() -> None:
    errors = cp_case(ParallelContext.single(), 37, seed=1)
    assert errors["logits"] <= 1e-5 and errors["kda_state"] <= 1e-5 and errors["mla_latent"] <= 1e-5
    assert errors["mismatched_tokens"] == 0 and errors["mla_bytes"] == 0 and errors["kda_bytes"] == 0


def test_too_few_pages_is_refused_by_name() -> None:
    model = build(debug())
    cache, pages = new_cache(model, 40)
    with pytest.raises(ValueError, match="pages must be one row of at least 3 page ids"):
        context_parallel_prefill(model, ParallelContext.single(), prompt(40, 0), cache, SLOT, pages[:2])
    assert torch.count_nonzero(cache.kda_state[0]) == 0


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict[str, dict[str, float]]]]:
    return {world: run_ranks(all_cases, world, LENGTHS, CONTEXT) for world in WORLDS}


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", CASES)
def test_prefill_and_greedy_decode_equal_one_process(results, world: int, case: str) -> None:
    for rank, by_case in enumerate(results[world]):
        e = by_case[case]
        for key in ("logits", "prompt_logprobs", "kda_state", "conv_state", "mla_latent"):
            assert e[key] <= 1e-5, f"rank {rank}: {key} differs by {e[key]}"
        assert e["whole_logits"] <= e["whole_chunked_logits"] + 1e-6, f"rank {rank}"
        assert e["mismatched_tokens"] == 0 and e["mismatched_whole_tokens"] == 0, f"rank {rank}"
        assert e["untouched_pages"] == 0 and e["attn_modules_restored"] == 1


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("length", LENGTHS)
def test_each_rank_receives_the_other_ranks_latents_and_its_predecessors_state(results, world: int, length: int) -> None:
    cfg = debug()
    n_mla, n_kda = len(cfg.mla_layers), cfg.num_hidden_layers - len(cfg.mla_layers)
    kda_hop = 4 * (cfg.kda.num_heads * cfg.kda.head_dim**2 + 3 * cfg.kda.proj_dim * (cfg.kda.conv_kernel - 1))
    for rank, (lo, hi) in enumerate(shard_bounds(length, world)):
        e = results[world][rank][str(length)]
        assert e["mla_bytes"] == n_mla * (length - (hi - lo)) * cfg.mla.latent_dim * 4
        assert e["kda_bytes"] == (n_kda * kda_hop if rank > 0 else 0)


def test_one_rank_after_a_context_is_the_chunked_prefill() -> None:
    errors = cp_case(ParallelContext.single(), 37, seed=2, context=10)
    assert errors["logits"] <= 1e-5 and errors["kda_state"] <= 1e-5 and errors["conv_state"] <= 1e-5 and errors["mla_latent"] <= 1e-5
    assert errors["mismatched_tokens"] == 0 and errors["mismatched_whole_tokens"] == 0


@pytest.mark.distributed
def test_cp_generate_gives_the_engines_greedy_tokens() -> None:
    # the one-process oracle is the whole engine (LLM: scheduler, chunked prefill, sampler) on the demo model
    from openk3.llm import LLM
    from openk3.serve.sampling import SamplingParams

    ids = [random.Random(0).randrange(1000) for _ in range(97)]
    llm = LLM("tiny", max_num_seqs=1)
    try:
        # cp_generate runs max_tokens steps whatever it samples, so the oracle does not stop at eos either
        want = list(llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids)
    finally:
        llm.close()
    for rank, got in enumerate(run_ranks(generate_case, 2, ids, 8)):
        assert got == want, f"rank {rank}"


@pytest.mark.distributed
def test_cp_over_tp_groups_equals_one_process_and_receives_the_planners_bytes() -> None:
    """cp=2 x tp=2 (4 gloo ranks): each TP shard's CP group exchanges the whole latents and its own heads' KDA state; the
    logits equal the whole model's in one process (fp32 reassociation), and each rank receives what the planner's CP
    term prices for one TP rank (cp_bytes at tp=2)."""
    from openk3.planner.inputs import Quantisation
    from openk3.planner.pp_cp import cp_bytes

    length = 64
    results = run_ranks(cp_tp_case, 4, 2, 2, length)
    want = cp_bytes(debug(), Quantisation(cache_dtype_bytes=4), tp=2, prompt=length, cp=2)
    for rank, e in enumerate(results):
        assert e["whole_logits"] <= 1e-4, f"rank {rank}: {e}"
        assert e["mla_bytes_per_layer"] == want.mla_per_layer, f"rank {rank}"
        assert e["kda_bytes_per_layer"] == (want.kda_hop if rank >= 2 else 0), f"rank {rank}: CP rank {rank // 2}"
