"""LLM(..., cp=N, decode_cp=True): decode context parallelism (parallel/cp/sharded_mla.py). Each CP rank's MLA pages hold
its interleaved share of the latents (position p on rank p % N); decode attends each share and merges the parts by LSE;
prefill chunks after a context attend each share and merge by LSE too. Greedy and seeded tokens equal one process, their logprobs and the prompt
logprobs to 1e-4 (fp32 reassociation), alone and batched (steps mixing prefill chunks and decode rows), over TP groups,
with the experts spread over the ranks and with prefix caching; rank 0's pools hold exactly the even positions of one
process's pages, at half the bytes per page."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import CacheTensors
from openk3.parallel.config import ParallelConfig
from openk3.serve.config import EngineConfig
from openk3.serve.sampling import SamplingParams
from tests.parallel.test_llm_cp import ENGINE, PROMPTS, SCORED, cp_step
from tests.parallel.test_llm_cp_prefix import one_process as one_process_prefix  # noqa: F401  # the fixture, shared
from tests.parallel.test_llm_cp_prefix import rounds

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
SEEDED = SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True, logprobs=0)


def run(llm: LLM) -> dict[str, Any]:
    try:
        out: dict[str, Any] = {}
        for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
            done = [o.outputs[0] for o in llm.generate(PROMPTS, params)]  # several sequences per step: prefill beside decode
            out[name] = [list(o.token_ids) for o in done]
            out[name + "_logprobs"] = [lp.logprob for o in done for lp in o.logprobs or ()]
        alone = [llm.generate([p], GREEDY)[0].outputs[0] for p in PROMPTS]
        out["alone"] = [list(o.token_ids) for o in alone]
        out["alone_logprobs"] = [lp.logprob for o in alone for lp in o.logprobs or ()]
        scored = llm.generate([PROMPTS[0]], SCORED)[0].prompt_logprobs
        assert scored is not None
        out["prompt_logprobs"] = [d.logprob for d in scored if d is not None]
        step = cp_step(llm)
        out["cp_steps"] = None if step is None else step.cp_steps
        return out
    finally:
        llm.close()


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    torch.set_num_threads(1)
    return run(LLM("tiny", **ENGINE))


@pytest.mark.distributed
@pytest.mark.parametrize(("cp", "tp", "ep"), [(2, 1, 1), (3, 1, 1), (2, 2, 1), (2, 1, 2)])
def test_dcp_tokens_and_logprobs_equal_one_process(one_process: dict[str, Any], cp: int, tp: int, ep: int) -> None:
    """cp = 3: uneven shares (48-token pages, 16 rows per rank; a sequence's last rank may hold one token fewer, or none
    of a 1- or 2-token context); tp = 2: each CP rank a TP group of two (4 ranks), each TP rank holding its CP rank's
    share of the latents and merging its own heads; ep = 2: the experts spread over both CP ranks."""
    torch.set_num_threads(1)
    page_size = 48 if cp == 3 else 16
    got = run(LLM("tiny", cp=cp, tp=tp, ep=ep, decode_cp=True, cp_min_tokens=32, page_size=page_size, **ENGINE))
    for key in ("greedy", "seeded", "alone"):
        assert got[key] == one_process[key], key
    for key in ("greedy_logprobs", "seeded_logprobs", "alone_logprobs", "prompt_logprobs"):
        assert len(got[key]) == len(one_process[key]) > 0, key
        assert got[key] == pytest.approx(one_process[key], abs=1e-4), key
    assert got["cp_steps"] > 0, "the long prompt's chunks were split as well"


@pytest.mark.distributed
def test_dcp_with_prefix_caching_gives_one_process_tokens_and_hits(one_process_prefix: dict[str, dict[str, Any]]) -> None:  # noqa: F811
    """A hit's pages are the engine's page ids, each rank holding its share of them; the tail page's copy-on-write is
    replayed on every rank's share."""
    torch.set_num_threads(1)
    want, cached = one_process_prefix["uncached"], one_process_prefix["cached"]
    got = rounds(LLM("tiny", cp=2, decode_cp=True, cp_min_tokens=32, enable_prefix_caching=True, **ENGINE))
    assert got["tokens"] == want["tokens"]
    assert got["logprobs"] == pytest.approx(cached["logprobs"], abs=1e-4)
    assert got["hits"] == cached["hits"] > 0


def _pools_after_one_long_prompt(**parallel: Any) -> tuple[list[torch.Tensor], int, int]:
    """(the MLA pools of rank 0, pages the prefix cache holds, pages in the pool) after one 300-token prompt."""
    llm = LLM("tiny", num_pages=64, enable_prefix_caching=True, **parallel, **ENGINE)
    try:
        llm.generate([PROMPTS[0]], GREEDY)
        cache = llm.engine.cache
        return [p.clone() for p in cache.tensors.mla_latent], cache.block_pool.num_used, cache.num_pages
    finally:
        llm.close()


@pytest.mark.distributed
def test_each_rank_holds_its_share_of_the_pages_at_half_the_bytes() -> None:
    """Measured on the block pool: the same pages are in use as in one process (the prefix cache holds the prompt's),
    each of them costing rank 0 half the bytes, and rank 0's rows are exactly one process's even positions."""
    torch.set_num_threads(1)
    one, used_one, n_one = _pools_after_one_long_prompt()
    two, used_two, n_two = _pools_after_one_long_prompt(cp=2, decode_cp=True, cp_min_tokens=32)
    assert used_two == used_one >= len(PROMPTS[0]) // 16 and n_two == n_one == 64
    bytes_one = used_one * sum(p[0].nbytes for p in one)
    bytes_two = used_two * sum(p[0].nbytes for p in two)
    assert bytes_two * 2 == bytes_one
    for a, b in zip(one, two, strict=True):
        assert b.shape == (a.shape[0], a.shape[1] // 2, a.shape[2])
        assert bool(a[:, 0::2].abs().sum() > 0)
        torch.testing.assert_close(b, a[:, 0::2], atol=1e-5, rtol=1e-5)


def test_decode_cp_settings_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match=r"decode_cp=True \(--dcp\) with cp=1"):
        ParallelConfig(decode_cp=True)
    with pytest.raises(ValueError, match="page_size=16 with cp=3, decode_cp=True: .* a multiple of cp"):
        ParallelConfig(cp=3, decode_cp=True).check_engine(EngineConfig())
    ParallelConfig(cp=3, decode_cp=True).check_engine(EngineConfig(page_size=12))
    ParallelConfig(cp=2, decode_cp=True).check_engine(EngineConfig(enable_prefix_caching=True))
    ParallelConfig(cp=2, decode_cp=True).check_engine(EngineConfig(enable_prefix_caching=True, cpu_offload_bytes=1 << 20))
    ParallelConfig(cp=2, decode_cp=True).check_engine(EngineConfig(enable_prefix_caching=True, disk_offload_dir="/tmp/openk3-never-made"))
    with pytest.raises(ValueError, match="speculative decoding runs in a single-process engine only"):
        ParallelConfig(cp=2, decode_cp=True).check_engine(EngineConfig(speculative_method="mtp"))
    with pytest.raises(ValueError, match="must be a multiple of latent_shards=3"):
        CacheTensors.allocate(debug(), 1, 2, 16, latent_shards=3)
    assert ParallelConfig(cp=2, decode_cp=True).latent_shards == 2 and ParallelConfig(cp=2).latent_shards == 1
