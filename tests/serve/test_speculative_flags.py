"""Speculative decoding from the entry points: `LLM(speculative_model=...)`, `openk3 serve --speculative-model` and vLLM's
`--speculative-config` JSON build the engine with a draft model; greedy output is the target's own; what openk3 does not
have (another method, a multi-rank layout) is refused by name."""

from __future__ import annotations

import warnings

import pytest
import torch

from openk3.cli import build_parser
from openk3.launch.server import server_configs
from openk3.llm import LLM
from openk3.parallel.config import ParallelConfig
from openk3.serve.config import EngineConfig
from openk3.serve.sampling import SamplingParams

PROMPTS = ["In the beginning God", "And the LORD said unto"]


def test_llm_with_a_draft_model_gives_the_targets_greedy_tokens() -> None:
    torch.set_num_threads(1)
    greedy = SamplingParams(max_tokens=16, temperature=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with LLM("tiny") as plain:
            want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, greedy)]
        with pytest.raises(ValueError, match="a draft must share the tokenizer"):
            LLM("tiny", speculative_model="debug")  # the debug preset's vocabulary is not the demo's
    with LLM("tiny", speculative_model="tiny", num_speculative_tokens=2) as spec:
        got = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, greedy)]
        stats = spec.engine.spec_stats
    assert got == want
    assert stats is not None and stats.num_drafts > 0 and stats.num_draft_tokens == 2 * stats.num_drafts
    assert stats.acceptance_rate == 1.0  # the draft is the target itself: every draft is the target's argmax


def serve_args(*flags: str):
    return build_parser().parse_args(["serve", *flags])


def test_vllms_speculative_config_is_the_two_flags() -> None:
    engine, _ = server_configs(serve_args("--speculative-config", '{"method": "draft_model", "model": "tiny", "num_speculative_tokens": 4}'))
    assert (engine.speculative_model, engine.num_speculative_tokens) == ("tiny", 4)
    engine, _ = server_configs(serve_args("--speculative-model", "tiny", "--num-speculative-tokens", "5"))
    assert (engine.speculative_model, engine.num_speculative_tokens) == ("tiny", 5)


@pytest.mark.parametrize(
    ("config", "error"),
    [
        ('{"method": "eagle3", "model": "x"}', "method='eagle3' is not supported"),
        ('{"model": "tiny", "draft_tensor_parallel_size": 2}', "key 'draft_tensor_parallel_size' is not read"),
        ('{"num_speculative_tokens": 2}', "needs 'model'"),
    ],
)
def test_what_speculative_config_cannot_honour_is_named(config: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        server_configs(serve_args("--speculative-config", config))


def test_a_key_given_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="both given"):
        server_configs(serve_args("--speculative-config", '{"model": "tiny"}', "--speculative-model", "debug"))


def test_a_multi_rank_layout_refuses_a_draft() -> None:
    with pytest.raises(ValueError, match="speculative_method=.draft_model. with ep=2"):
        ParallelConfig(ep=2).check_engine(EngineConfig(speculative_model="tiny"))
