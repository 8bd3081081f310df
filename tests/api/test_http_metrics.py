"""/metrics as a stock vLLM dashboard reads it: with `--metrics-prefix vllm:` the engine's families carry vLLM's own names
(and the older ones its example Grafana dashboard reads) with the `model_name` label; HTTP requests are counted by route
template, method and status class, with bounded labels whatever a client sends (fake clock: no sleeping)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from openk3.api.http_metrics import HTTPMetrics, HTTPMetricsMiddleware
from openk3.api.metrics import ServerMetrics, check_prefix
from openk3.cli import build_parser
from openk3.launch import cli
from tests.api.conftest import LiveServer, start_server, stop_server

# what the vLLM example dashboard and vLLM v1's PrometheusStatLogger export, as the dashboard queries them
DASHBOARD = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:gpu_cache_usage_perc",
    "vllm:cpu_cache_usage_perc",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_queue_time_seconds_bucket",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:iteration_tokens_total_bucket",
    "vllm:cache_config_info",
)


def sample(text: str, name: str, **labels: str) -> float:
    """The one sample of `name` whose labels include `labels`."""
    found = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, (name, labels, found)
    return found[0]


@pytest.fixture(scope="module")
def vllm_named(torch_one_thread) -> Iterator[LiveServer]:
    server = start_server(server={"metrics_prefix": "vllm:"})
    yield server
    stop_server(server)


def test_the_vllm_prefix_gives_a_stock_dashboards_names(vllm_named: LiveServer) -> None:
    with httpx.Client(base_url=vllm_named.base_url, timeout=60) as http:
        for _ in range(2):
            r = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True})
            assert r.status_code == 200
        assert http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200
        # an answer can leave before the engine thread records its step's metrics; a command runs after that, between steps
        vllm_named.in_loop(vllm_named.frontend.call(lambda engine: None))
        text = http.get("/metrics").text
    for name in DASHBOARD:
        assert re.search(rf"^{re.escape(name)}\{{[^}}]*model_name=\"debug\"", text, re.M), name
    assert "openk3:num_requests_running" not in text
    assert sample(text, "vllm:generation_tokens_total") == 4 + 4 + 2
    assert sample(text, "vllm:request_success_total", finished_reason="length") == 3
    # the older time_per_output_token_seconds is the token-gap histogram (3 + 3 + 1 gaps); the per-request one has 3 samples
    gaps = sample(text, "vllm:inter_token_latency_seconds_count")
    assert gaps == sample(text, "vllm:time_per_output_token_seconds_count") == 7
    assert sample(text, "vllm:request_time_per_output_token_seconds_count") == 3
    assert sample(text, "vllm:gpu_cache_usage_perc") == sample(text, "vllm:kv_cache_usage_perc")
    # the HTTP families, as prometheus-fastapi-instrumentator names them
    assert sample(text, "http_requests_total", handler="/v1/completions", method="POST", status="2xx") == 2
    assert sample(text, "http_requests_total", handler="/v1/chat/completions", method="POST", status="2xx") == 1
    assert sample(text, "http_request_duration_seconds_count", handler="/v1/completions", method="POST") == 2


def test_a_bad_prefix_is_refused_naming_the_flag(capsys) -> None:
    assert check_prefix("vllm:") == "vllm:" and check_prefix("") == ""
    for bad in ("9x", "vllm-", "a b"):
        with pytest.raises(ValueError, match="--metrics-prefix"):
            ServerMetrics("m", bad)
    # `openk3 serve` refuses it with one line and exit 2, before the port is claimed or any weights load
    assert cli.run(build_parser().parse_args(["serve", "--model", "no-such-model", "--metrics-prefix", "vllm-"])) == 2
    assert "--metrics-prefix 'vllm-'" in capsys.readouterr().err


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def instrumented(clock: FakeClock) -> tuple[FastAPI, CollectorRegistry]:
    app = FastAPI()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        clock.now += 0.25
        return {"id": model_id}

    @app.post("/boom")
    async def boom() -> dict:
        raise RuntimeError("handler failed")

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def body() -> Iterator[bytes]:  # type: ignore[misc]
            for piece in (b"a", b"b", b"c"):
                clock.now += 1.0  # the duration runs to the stream's last byte
                yield piece

        return StreamingResponse(body())

    @app.get("/metrics")
    async def metrics() -> dict:
        return {}

    registry = CollectorRegistry()
    app.add_middleware(HTTPMetricsMiddleware, metrics=HTTPMetrics(registry), clock=clock)
    return app, registry


def test_routes_are_templated_and_labels_stay_bounded() -> None:
    clock = FakeClock()
    app, registry = instrumented(clock)

    async def drive() -> None:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            for i in range(50):  # fifty raw paths, one route: one series
                assert (await client.get(f"/v1/models/org/model-{i}")).status_code == 200
            for i in range(20):  # no route at all: one `none` series, whatever the paths
                assert (await client.get(f"/nothing/{i}")).status_code == 404
            assert (await client.request("FROBNICATE", "/v1/models/x")).status_code == 405
            assert (await client.get("/boom")).status_code == 405  # a wrong method on a known path keeps its template
            assert (await client.post("/boom")).status_code == 500
            assert (await client.get("/stream")).text == "abc"
            assert (await client.get("/metrics")).status_code == 200  # scrapes are not counted

    asyncio.run(drive())
    text = generate_latest(registry).decode()
    series = [line for line in text.splitlines() if line.startswith("http_requests_total{")]
    assert sample(text, "http_requests_total", handler="/v1/models/{model_id:path}", method="GET", status="2xx") == 50
    assert sample(text, "http_requests_total", handler="none", method="GET", status="4xx") == 20
    assert sample(text, "http_requests_total", handler="/v1/models/{model_id:path}", method="other", status="4xx") == 1
    assert sample(text, "http_requests_total", handler="/boom", method="GET", status="4xx") == 1
    assert sample(text, "http_requests_total", handler="/boom", method="POST", status="5xx") == 1
    assert len(series) == 6 and "/metrics" not in text and "model-1" not in text and "nothing" not in text
    assert sample(text, "http_request_duration_seconds_sum", handler="/v1/models/{model_id:path}", method="GET") == pytest.approx(50 * 0.25)
    assert sample(text, "http_request_duration_seconds_sum", handler="/stream", method="GET") == pytest.approx(3.0)
