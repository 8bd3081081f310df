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


def test_vllms_eagle3_config_is_the_method_and_head_folder() -> None:
    engine, _ = server_configs(serve_args("--speculative-config", '{"method": "eagle3", "model": "/heads/e3", "num_speculative_tokens": 2}'))
    assert (engine.speculative, engine.speculative_model, engine.num_speculative_tokens) == ("eagle3", "/heads/e3", 2)
    engine, _ = server_configs(serve_args("--speculative-method", "eagle3", "--speculative-model", "tiny/eagle3"))
    assert (engine.speculative, engine.speculative_model) == ("eagle3", "tiny/eagle3")
    with pytest.raises(ValueError, match="speculative_method='eagle3' needs speculative_model"):
        EngineConfig(speculative_method="eagle3")


@pytest.mark.parametrize(
    ("config", "error"),
    [
        ('{"method": "eagle", "model": "x"}', "method='eagle' is not supported"),
        ('{"method": "eagle3", "num_speculative_tokens": 2}', "method 'eagle3' needs 'model'"),
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


def test_the_server_exports_vllms_spec_decode_counters() -> None:
    import httpx

    from openk3.launch.server import build_server
    from tests.api.conftest import serve_app, stop_server

    torch.set_num_threads(1)
    args = serve_args("--speculative-config", '{"model": "tiny", "num_speculative_tokens": 2}', "--max-num-seqs", "2", "--cache-memory-mb", "16")
    live = serve_app(build_server(args))
    try:
        with httpx.Client(base_url=live.base_url, timeout=120) as http:
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 9, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200
            live.in_loop(live.frontend.call(lambda e: None))  # the engine thread has published the steps' stats by now
            text = http.get("/metrics").text
    finally:
        stop_server(live)

    def value(name: str) -> float:
        line = next(line for line in text.splitlines() if line.startswith(f"openk3:{name}{{"))
        return float(line.rsplit(" ", 1)[1])

    drafts, proposed, accepted = (
        value("spec_decode_num_drafts_total"),
        value("spec_decode_num_draft_tokens_total"),
        value("spec_decode_num_accepted_tokens_total"),
    )
    assert drafts > 0 and drafts < proposed <= 2 * drafts and accepted == proposed  # k cut near max_tokens; the draft is the target
    per_pos = [line for line in text.splitlines() if line.startswith("openk3:spec_decode_num_accepted_tokens_per_pos_total{")]
    assert len(per_pos) == 2 and sum(float(line.rsplit(" ", 1)[1]) for line in per_pos) == accepted
