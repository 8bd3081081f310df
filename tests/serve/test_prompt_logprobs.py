"""Prompt logprobs scored in the prefill forward (serve/prompt_logprobs.py) equal the model's own cache-free forward to 1e-4
(fp32, the debug K3 model): per token and summed over a continuation (what lm-eval's loglikelihood adds up), whole or in
prefill chunks, beside requests that do not ask, and with prefix caching on where the context is cached (a request that
asks is refused the hit and computes it all)."""

import random
from typing import Any

import pytest
import torch

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer

BASE: dict[str, Any] = dict(page_size=4, num_pages=160, max_num_seqs=4, max_model_len=256)
TOLERANCE = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model() -> K3ForCausalLM:
    m = K3ForCausalLM(debug())
    m.init_weights(seed=5)
    return m.eval()


def reference(model: K3ForCausalLM, ids: list[int]) -> tuple[list[float], torch.Tensor]:
    """logprob of ids[i] given ids[:i], for i = 1.., from one cache-free forward; and the full [L - 1, V] logprobs."""
    with torch.inference_mode():
        logprobs = model.forward_tokens(torch.tensor([ids])).float().log_softmax(-1)[0, :-1]
    return logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist(), logprobs


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


@pytest.mark.parametrize("chunk", [None, 5, 16])
def test_prompt_logprobs_equal_the_models_own_forward(model, chunk) -> None:
    context, continuation = tokens(1, 37), tokens(2, 6)
    prompt = context + continuation
    llm = LLM(model, ByteTokenizer(256), long_prefill_token_threshold=chunk, **BASE)
    bystander = SamplingParams(temperature=0, max_tokens=3)  # in the same steps, asks for nothing: its rows are not scored
    asks = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)
    out, other = llm.generate([prompt, tokens(3, 20)], [asks, bystander])
    assert other.prompt_logprobs is None
    got = out.prompt_logprobs
    assert got is not None and [lp.token_id for lp in got] == prompt[1:]
    want, full = reference(model, prompt)
    worst = max(abs(g.logprob - w) for g, w in zip(got, want, strict=True))
    assert worst < TOLERANCE, worst
    summed = sum(lp.logprob for lp in got[len(context) - 1 :])
    assert abs(summed - sum(want[len(context) - 1 :])) < TOLERANCE
    for g, row in zip(got, full, strict=True):
        assert g.rank == int((row > row[g.token_id]).sum()) + 1
        assert [t for t, _ in g.top] == row.topk(3).indices.tolist()


def test_a_cached_context_is_recomputed_for_a_request_that_asks(model) -> None:
    context = tokens(4, 48)
    llm = LLM(model, ByteTokenizer(256), long_prefill_token_threshold=16, enable_prefix_caching=True, prefix_match_unit=8, num_snapshot_slots=6, **BASE)
    llm.generate([context + tokens(5, 4)], SamplingParams(temperature=0, max_tokens=2))  # caches the context
    prompt = context + tokens(6, 5)
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
    assert plain.num_cached_tokens >= 32  # a request that does not ask hits the cache
    scored = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    assert scored.num_cached_tokens == 0
    want, _ = reference(model, prompt)
    got = scored.prompt_logprobs
    assert got is not None and max(abs(g.logprob - w) for g, w in zip(got, want, strict=True)) < TOLERANCE
    assert all(lp.top == () for lp in got)


def test_n_samples_score_the_prompt_once_and_a_one_token_prompt_scores_nothing(model) -> None:
    llm = LLM(model, ByteTokenizer(256), **BASE)
    out = llm.generate([tokens(7, 9)], SamplingParams(n=3, temperature=1, seed=0, max_tokens=2, prompt_logprobs=1))[0]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == 8 and len(out.outputs) == 3
    single = llm.generate([[42]], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
    assert single.prompt_logprobs == ()
