"""The prefix cache's counters reach /metrics: per-tier bytes, hits and snapshots, and the CLI flags reach EngineConfig."""

import re

import torch

from openk3.api.metrics import ServerMetrics
from openk3.config import debug
from openk3.model import K3ForCausalLM
from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer


def sample(text: str, name: str, tier: str | None = None) -> float:
    labels = r'\{[^}]*tier="' + tier + r'"[^}]*\}' if tier else r"\{[^}]*\}"
    match = re.search(rf"^openk3:{name}{labels} (\S+)$", text, re.M)
    assert match, (name, tier)
    return float(match.group(1))


def test_tier_metrics_follow_the_engine() -> None:
    model = K3ForCausalLM(debug())
    model.init_weights(seed=0)
    cfg = EngineConfig(num_pages=64, page_size=4, max_num_seqs=2, max_model_len=128, enable_prefix_caching=True, num_snapshot_slots=1, cpu_offload_bytes=2**20)
    engine = LLMEngine(model.eval(), ByteTokenizer(256), cfg)
    metrics = ServerMetrics("m")
    greedy = SamplingParams(temperature=0, max_tokens=2)
    with torch.inference_mode():
        for i, prompt in enumerate(([5] * 12, [6] * 12, [5] * 12 + [1])):  # the third hits the first, offloaded to host
            engine.add_request(str(i), prompt, greedy)
            while engine.has_unfinished():
                engine.step()
            metrics.observe_engine(engine)
    text = metrics.render().decode()
    assert sample(text, "cache_tier_hits_total", "host") == 1
    assert sample(text, "cache_tier_bytes_out_total", "host") > 0 and sample(text, "cache_tier_bytes_in_total", "host") > 0
    assert sample(text, "cache_tier_used_bytes", "host") > 0 and sample(text, "cache_tier_capacity_bytes", "host") == 2**20
    assert sample(text, "prefix_cache_snapshots_taken_total") >= 3 and sample(text, "prefix_cache_snapshots_evicted_total") >= 2
    assert sample(text, "cache_tier_used_bytes", "disk") == 0


def test_shared_prefill_waits_reach_metrics() -> None:
    """Two prompts with one new 16-token prefix added together: the second waits for the first's prefill (shared_prefill.py)."""
    model = K3ForCausalLM(debug())
    model.init_weights(seed=0)
    cfg = EngineConfig(num_pages=64, page_size=4, max_num_seqs=2, max_model_len=128, enable_prefix_caching=True, prefix_match_unit=4)
    engine = LLMEngine(model.eval(), ByteTokenizer(256), cfg)
    metrics = ServerMetrics("m")
    greedy = SamplingParams(temperature=0, max_tokens=2)
    with torch.inference_mode():
        engine.add_request("a", [7] * 16 + [1], greedy)
        engine.add_request("b", [7] * 16 + [2], greedy)
        while engine.has_unfinished():
            engine.step()
    metrics.observe_engine(engine)
    text = metrics.render().decode()
    assert sample(text, "prefix_cache_shared_prefill_waits_total") == 1
    stats = engine.stats().prefix_cache
    assert stats is not None and stats.hits == 1 and stats.hit_tokens == 16


def test_cli_flags_reach_engine_config() -> None:
    from openk3.cli import build_parser
    from openk3.launch.flags import engine_configs

    args = build_parser().parse_args(
        ["serve", "--enable-prefix-caching", "--prefix-match-unit", "32", "--cpu-offload-gb", "0.5", "--disk-offload-dir", "/tmp/x", "--disk-offload-gb", "2"]
    )
    cfg, _ = engine_configs(args)
    assert isinstance(cfg, EngineConfig)
    assert (cfg.enable_prefix_caching, cfg.prefix_match_unit, cfg.cpu_offload_bytes, cfg.disk_offload_dir, cfg.disk_offload_bytes) == (
        True,
        32,
        2**29,
        "/tmp/x",
        2 * 2**30,
    )


def test_server_reports_cached_tokens_in_usage() -> None:
    import pytest
    from fastapi.testclient import TestClient

    from openk3.cli import build_parser
    from openk3.launch.server import build_server

    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            "debug",
            "--max-model-len",
            "128",
            "--max-num-seqs",
            "2",
            "--cache-memory-mb",
            "4",
            "--page-size",
            "4",
            "--enable-prefix-caching",
            "--prefix-match-unit",
            "8",
        ]
    )
    with pytest.warns(UserWarning, match="random weights"):
        app = build_server(args)
    prompt = list(range(10, 50))
    body = {"model": "debug", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    with TestClient(app) as client:
        replies = [client.post("/v1/completions", json=body).json() for _ in range(3)]
        text = client.get("/metrics").text
    # the 1st took states inside its prefill at the match units 8..32: the 2nd hits 32, the last full unit below its end; it
    # finds the whole prompt cached but no state before its last token, so it cuts there (a branch point) and the 3rd hits 39
    assert [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies] == [0, 32, 39]
    assert len({r["choices"][0]["text"] for r in replies}) == 1
    assert sample(text, "cache_tier_hits_total", "device") == 2 and sample(text, "prompt_tokens_cached_total") == 32 + 39
