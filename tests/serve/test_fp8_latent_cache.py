"""The FP8 MLA latent cache (`kv_cache_dtype="fp8"`): pages hold packed e4m3 rows with their scales, the attention reads
the step's pages dequantised, sizing counts the packed bytes, and prefix-cache hits (snapshots, page copies) are exact:
cached == uncached under the same cache format. Accuracy against the full-precision cache is measured in
benchmarks/fp8_latent_cache.py."""

from __future__ import annotations

import warnings

import pytest
import torch

from openk3.config import preset
from openk3.config.cache_format import fp8_groups
from openk3.llm import LLM
from openk3.parallel.config import ParallelConfig
from openk3.serve.cache.hashing import model_salt
from openk3.serve.cache.spec import CacheSpec
from openk3.serve.config import EngineConfig
from openk3.serve.sampling import SamplingParams

PROMPTS = ["In the beginning God created the heaven and the earth. And the earth was without form", "And the LORD said unto Moses,"]
GREEDY = SamplingParams(max_tokens=24, temperature=0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    yield
    torch.set_num_threads(before)


def generate(**config) -> tuple[list[tuple[int, ...]], LLM]:
    llm = LLM("tiny", max_num_seqs=4, cache_memory_bytes=32 * 2**20, **config)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)], llm


def test_pages_are_packed_rows_and_greedy_output_stays_close() -> None:
    plain, llm = generate()
    llm.close()
    fp8, llm = generate(kv_cache_dtype="fp8")
    pool = llm.engine.cache.tensors.mla_latent[0]
    r = llm.engine.model_config.mla.latent_dim
    assert pool.dtype == torch.uint8 and pool.shape[-1] == r + 4 * fp8_groups(r)
    llm.close()
    agree = [sum(a == b for a, b in zip(p, f, strict=True)) / len(p) for p, f in zip(plain, fp8, strict=True)]
    assert min(agree) >= 0.75, agree


def test_prefix_hits_are_exact_under_fp8() -> None:
    want, llm = generate(kv_cache_dtype="fp8")
    llm.close()
    llm = LLM("tiny", max_num_seqs=4, cache_memory_bytes=32 * 2**20, kv_cache_dtype="fp8", enable_prefix_caching=True, prefix_match_unit=16)
    try:
        for _ in range(3):
            outs = llm.generate(PROMPTS, GREEDY)
            assert [o.outputs[0].token_ids for o in outs] == want
        assert outs[0].num_cached_tokens > 0
        llm.engine.check_integrity()
    finally:
        llm.close()


def test_sizing_salt_and_layouts() -> None:
    config = preset("tiny")
    r, layers = config.mla.latent_dim, len(config.mla_layers)
    fp8 = CacheSpec.from_config(config, 16, cache_dtype_bytes=2, fp8_latent=True)
    assert fp8.mla.bytes_per_token == layers * (r + 4 * fp8_groups(r))
    assert fp8.mla.bytes_per_token < CacheSpec.from_config(config, 16, cache_dtype_bytes=2).mla.bytes_per_token * 0.6
    assert fp8.kda == CacheSpec.from_config(config, 16, cache_dtype_bytes=2).kda  # the KDA state and windows are untouched
    assert model_salt(config, None, torch.float32, fp8_latent=True) != model_salt(config, None, torch.float32)
    ParallelConfig(ep=2).check_engine(EngineConfig(kv_cache_dtype="fp8"))  # multi-rank: tests/parallel/test_multi_rank_fp8.py
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")
