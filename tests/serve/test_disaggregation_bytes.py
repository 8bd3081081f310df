"""The bytes a hand-off moves, measured on the runtime record, equal the planner's prefill -> decode transfer
(planner/disagg.py `transfer`) for the engine's own config and dtypes, plus the record's stated header overhead.

One difference is by design, not a bug: for a prompt of P tokens the prefill engine exports the boundary P - 1 (the decode
engine computes P[-1] itself for its first logits), so the record carries P - 1 latents while the planner prices P; the
planner is one token's latent (spec.mla.bytes_per_token) conservative per request."""

import dataclasses
import random

import pytest
import torch

from openk3.config import debug, k3
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.model.batch import CacheTensors
from openk3.planner.disagg import transfer
from openk3.planner.hardware import load_catalogue
from openk3.planner.inputs import Layout, Quantisation, Workload
from openk3.planner.memory import cache_spec
from openk3.planner.perf import Scenario
from openk3.serve.cache import tier_record
from openk3.serve.cache.transfer import buffer_nbytes
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer

SYSTEM = load_catalogue().system("gb300-nvl72")
ONE = Layout(1)


def planner_bytes(config, prompt: int, cache_bytes: int, state_bytes: int = 4) -> float:
    sc = Scenario(config, Quantisation(cache_dtype_bytes=cache_bytes, state_dtype_bytes=state_bytes), ONE, Workload(context=prompt, concurrency=1), SYSTEM)
    return transfer(sc, prompt, ONE, ONE, inside_domain=True).bytes


@pytest.fixture(scope="module")
def model() -> K3ForCausalLM:
    m = K3ForCausalLM(debug())
    m.init_weights(seed=5)
    return m.eval()


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_record_payload_is_the_planner_transfer(model, cache_dtype) -> None:
    n = 150  # the prompt; the record holds its first n - 1 tokens
    rng = random.Random(n)
    p = [rng.randrange(256) for _ in range(n)]
    llm = LLM(model, ByteTokenizer(256), page_size=64, num_pages=8, max_num_seqs=1, enable_prefix_caching=True, cache_dtype=cache_dtype)
    llm.generate([p[:-1]], SamplingParams(temperature=0, max_tokens=1))
    record = llm.engine.export_prefix(p[:-1])
    llm.close()
    assert record is not None
    e = tier_record.decode(record)
    cache_bytes = torch.empty((), dtype=cache_dtype).element_size()
    spec = cache_spec(debug(), Quantisation(cache_dtype_bytes=cache_bytes))
    assert e.num_tokens == n - 1
    assert e.nbytes == planner_bytes(debug(), n - 1, cache_bytes)
    assert e.nbytes == planner_bytes(debug(), n, cache_bytes) - spec.mla.bytes_per_token  # the one latent the decode side computes
    assert len(record) == e.nbytes + tier_record.overhead_bytes(e)
    # magic (14) + length (8) + JSON header: about 240 B, plus up to 5 B per tail token (fewer than a page)
    assert tier_record.overhead_bytes(e) <= 256 + 5 * len(e.tail)


@pytest.mark.parametrize("config", [debug(), k3(), dataclasses.replace(debug(), name="no-mla", mla_layers=())], ids=lambda c: c.name)
def test_buffer_size_is_the_planner_transfer(config) -> None:
    """Without running a model (K3's state alone is 449 MB): the pools the engine would allocate, on the meta device."""
    for dtype in (torch.bfloat16, torch.float32):
        pools = CacheTensors.allocate(config, 1, 1, 64, dtype=dtype, device="meta")
        for tokens in (1, 63, 64, 8191):
            assert buffer_nbytes(pools, tokens) == planner_bytes(config, tokens, torch.empty((), dtype=dtype).element_size())
