"""Metrics registry per server; the benchmark's arithmetic, datasets and one short run against the live server; the CLI."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest

from openk3.api.bench import add_arguments, benchmark
from openk3.api.bench_data import DatasetConfig, ideal_prefix_hit_rate, make_requests
from openk3.api.bench_metrics import RequestResult, parse_goodput, summarize, tpot
from openk3.api.metrics import ServerMetrics
from openk3.serve.async_engine import FinishedRequest
from openk3.serve.sampling import SamplingParams
from tests.api.conftest import MAX_NUM_SEQS, NUM_PAGES, debug_engine, metric

VLLM_NAMES = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "prompt_tokens_cached_total",
    "num_preemptions_total",
    "time_to_first_token_seconds_bucket",
    "inter_token_latency_seconds_bucket",
    "e2e_request_latency_seconds_bucket",
    "request_queue_time_seconds_bucket",
    "prompt_tokens_total",
    "generation_tokens_total",
    "cache_tier_used_bytes",
)


def test_metrics_names_values_and_separate_registries(torch_one_thread) -> None:
    a, b = ServerMetrics("m"), ServerMetrics("m")  # two servers in one process must not collide
    engine = debug_engine()
    a.observe_engine(engine)
    engine.add_request("r", list(b"hello"), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    a.observe_engine(engine)
    text = a.render().decode()
    for name in VLLM_NAMES:
        assert f"openk3:{name}" in text, name
    assert metric(text, "num_requests_running") == 1 and metric(text, "kv_cache_usage_perc") == 1 / NUM_PAGES  # 5 + 1 tokens: one page
    assert metric(text, "kda_state_usage_perc") == 1 / MAX_NUM_SEQS and metric(text, "cache_tier_used_bytes") > 0
    while engine.has_unfinished():
        engine.step()
    a.observe_engine(engine)
    a.observe_prompt(10, 4)
    a.observe_tokens([0.01, 0.02])
    a.observe_finished(FinishedRequest("stop", 0.1, 0.2, 0.5))
    text = a.render().decode()
    assert metric(text, "generation_tokens_total") == 3 and metric(text, "prompt_tokens_total") == 5  # the engine's totals, once
    assert metric(text, "num_requests_running") == 0 and metric(text, "kv_cache_usage_perc") == 0 and metric(text, "cache_tier_used_bytes") == 0
    assert metric(text, "prefix_cache_hits_total") == 0 and metric(text, "prefix_cache_queries_total") == 0  # caching is off
    assert metric(text, "inter_token_latency_seconds_count") == 2
    assert 'openk3:request_success_total{finished_reason="stop",model_name="m"} 1.0' in text
    assert 'openk3:generation_tokens_total{model_name="m"} 0.0' in b.render().decode()


def test_summary_arithmetic() -> None:
    results = [
        RequestResult(True, 10, 5, ttft=0.1, latency=0.5, itl=[0.1] * 4),  # tpot (0.5 - 0.1) / 4 = 0.1
        RequestResult(True, 10, 1, ttft=0.3, latency=0.3),  # one token: no tpot
        RequestResult(False, error="HTTP 500"),
    ]
    assert tpot(results[0]) == pytest.approx(0.1) and tpot(results[1]) is None
    s = summarize(results, duration=2.0, slos={"ttft": 200.0})
    assert s["completed"] == 2 and s["failed"] == 1 and s["total_output_tokens"] == 6
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 3.0 and s["total_token_throughput"] == 13.0
    assert s["mean_ttft_ms"] == pytest.approx(200.0) and s["median_tpot_ms"] == pytest.approx(100.0)
    assert s["p99_ttft_ms"] == pytest.approx(298.0) and "p90_ttft_ms" not in s  # vLLM's default percentiles: 99 only
    assert summarize(results, 2.0, {}, [50, 90])["p90_ttft_ms"] == pytest.approx(280.0)
    assert s["request_goodput"] == 0.5  # only the first meets ttft <= 200 ms
    assert s["error_kinds"] == ["HTTP 500"] and s["errors"] == ["", "", "HTTP 500"] and s["itls"] == [[0.1] * 4, [], []]
    assert s["input_lens"] == [10, 10, 0] and s["output_lens"] == [5, 1, 0]
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    with pytest.raises(ValueError, match="key"):
        parse_goodput(["speed:1"])


def test_datasets_are_seeded_and_exact() -> None:
    pool = list(range(100, 200))
    random = make_requests(DatasetConfig("random", 5, seed=1, input_len=30, output_len=7), pool)
    assert [r.input_len for r in random] == [30] * 5 and {r.output_len for r in random} == {7}
    assert random == make_requests(DatasetConfig("random", 5, seed=1, input_len=30, output_len=7), pool)
    cfg = DatasetConfig("prefix_repetition", 8, prefix_len=20, suffix_len=5, num_prefixes=2)
    reps = make_requests(cfg, pool)
    assert len({tuple(r.prompt[:20]) for r in reps}) == 2 and all(r.input_len == 25 for r in reps)
    assert ideal_prefix_hit_rate(cfg) == pytest.approx(20 / 25 * (1 - 2 / 8))
    convs = make_requests(DatasetConfig("multiturn", 7, num_turns=3), None)
    assert [len(c.turns) for c in convs] == [3, 3, 1]
    with pytest.raises(ValueError, match="dataset"):
        DatasetConfig("alpaca", 1)
    with pytest.raises(ValueError, match="dataset-path"):
        DatasetConfig("sharegpt", 1)


@pytest.mark.parametrize("dataset", ["random", "multiturn", "sharegpt", "random-chat"])
def test_bench_against_the_live_server(live, tmp_path, dataset) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sharegpt = ["--dataset-path", str(Path(__file__).parent / "data" / "sharegpt_sample.json"), "--sharegpt-output-len", "5"]
    args = parser.parse_args(
        [
            *(sharegpt if dataset == "sharegpt" else []),
            "--base-url",
            live.base_url,
            "--dataset",
            dataset.removesuffix("-chat"),
            "--backend",
            "openai-chat" if dataset.endswith("-chat") else "openai",
            "--num-prompts",
            "4",
            "--max-concurrency",
            "2",
            "--input-len",
            "16",
            "--output-len",
            "5",
            "--turn-len",
            "4",
            "--num-turns",
            "2",
            "--disable-tqdm",
            "--goodput",
            "ttft:60000",
        ]
    )
    result = asyncio.run(benchmark(args))
    assert result["completed"] == 4 and result["failed"] == 0 and result["total_output_tokens"] == 20
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    if dataset == "random":
        assert result["total_input_tokens"] == 4 * 16
    if dataset == "random-chat":  # the prompts, spelled out by /detokenize, went as one user message each
        assert result["endpoint"] == "/v1/chat/completions" and result["total_input_tokens"] > 4 * 16
    if dataset == "sharegpt":  # the debug tokenizer is bytes: all four human turns fit (8, 35, 54 and 63 bytes)
        assert sorted(result["input_lens"]) == [8, 35, 54, 63]
    assert result["max_output_tokens_per_s"] > 0 and len(result["ttfts"]) == 4 and result["errors"] == [""] * 4
    json.dumps(result)


def test_cli_registers_serve_and_bench_serve() -> None:
    from openk3.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "debug", "--port", "9", "--api-key", "k", "--max-model-len", "64", "--max-num-seqs", "4"])
    assert (args.model, args.port, args.api_key, args.max_model_len, args.max_num_seqs) == ("debug", 9, "k", 64, 4)
    args = parser.parse_args(["bench", "serve", "--dataset", "prefix_repetition", "--request-rate", "5", "--num-prompts", "3", "--seed", "2"])
    assert (args.dataset, args.request_rate, args.num_prompts, args.seed) == ("prefix_repetition", 5.0, 3, 2)
    assert (args.burstiness, args.ignore_eos, args.percentile_metrics, args.metric_percentiles) == (1.0, True, "ttft,tpot,itl", "99")
    argv = ["bench", "serve", "--dataset", "sharegpt", "--dataset-path", "f.json", "--burstiness", "0.5", "--no-ignore-eos"]
    args = parser.parse_args([*argv, "--sharegpt-output-len", "7", "--percentile-metrics", "e2el", "--metric-percentiles", "50,99"])
    assert (args.dataset_path, args.burstiness, args.ignore_eos, args.sharegpt_output_len) == ("f.json", 0.5, False, 7)


def test_build_server_from_cli_arguments(tmp_path) -> None:
    from fastapi.testclient import TestClient

    from openk3.cli import build_parser
    from openk3.launch.server import build_server

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            "debug",
            "--served-model-name",
            "d",
            "--max-model-len",
            "64",
            "--max-num-seqs",
            "2",
            "--cache-memory-mb",
            "4",
            "--chat-template",
            str(template),
            "--api-key",
            "k",
        ]
    )
    with pytest.warns(UserWarning, match="random weights"):
        app = build_server(args)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        card = client.get("/v1/models", headers={"Authorization": "Bearer k"}).json()["data"][0]
        assert (card["id"], card["root"], card["max_model_len"]) == ("d", "debug", 64)
        assert client.post("/tokenize", json={"messages": [{"role": "user", "content": "ab"}]}).json()["tokens"] == list(b"ab")
