"""The FP8 latent cache (`kv_cache_dtype="fp8"`) on multi-rank engines: rank 0 announces the packed page format with the
pools' shapes (step_channel CACHE), every worker allocates uint8 pages of the same rows, and the prefix cache's page copies
replay on them; under --dp each rank's engine allocates its own. `LLM("tiny", kv_cache_dtype="fp8")` over TP, EP, CP and
DP ranks gives one process's tokens, hit counts and logprobs with prefix caching on (test_llm_cp_prefix's sends: repeats
and extensions hit their snapshots). Refused by name: fp8 with decode context parallelism (its ranks read their share of
the pages unpacked)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from openk3.llm import LLM
from openk3.parallel.config import ParallelConfig
from openk3.serve.config import EngineConfig
from tests.parallel.test_llm_cp_prefix import ENGINE, sends

FP8: dict[str, Any] = dict(kv_cache_dtype="fp8", enable_prefix_caching=True, **ENGINE)


def rounds(llm: LLM) -> dict[str, Any]:
    try:
        pool = llm.engine.cache.tensors.mla_latent[0]
        assert pool.dtype == torch.uint8, "rank 0's pages are packed"
        outs = sends(llm)
        stats = llm.engine.stats().prefix_cache
        assert stats is not None
        return {"tokens": [list(o.token_ids) for o in outs], "logprobs": [lp.logprob for o in outs for lp in o.logprobs or ()], "hits": stats.hit_tokens}
    finally:
        llm.close()


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    torch.set_num_threads(1)
    return rounds(LLM("tiny", **FP8))


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [dict(tp=2), dict(ep=2), dict(cp=2, cp_min_tokens=32), dict(dp=2, ep=2)], ids=["tp2", "ep2", "cp2", "dp2"])
def test_fp8_pages_on_multi_rank_engines_give_one_process_results(one_process: dict[str, Any], layout: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    want = one_process
    assert want["hits"] > 0, "the one-process oracle hits its prefixes"
    got = rounds(LLM("tiny", **layout, **FP8))
    assert got["hits"] == want["hits"]
    assert got["tokens"] == want["tokens"]
    assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)


def test_fp8_is_refused_with_decode_cp_only() -> None:
    fp8 = EngineConfig(kv_cache_dtype="fp8")
    for layout in (ParallelConfig(tp=2), ParallelConfig(ep=2), ParallelConfig(cp=2), ParallelConfig(cp=2, tp=2), ParallelConfig(dp=2, ep=2)):
        layout.check_engine(fp8)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' with cp=2, ep=1, decode_cp=True: .*not supported with decode context parallelism"):
        ParallelConfig(cp=2, decode_cp=True).check_engine(fp8)
