"""The worker endpoints sglang-router / sgl-model-gateway reads (openk3/api/routes/router_info.py, health_generate.py):
/server_info and /model_info (and their get_ names) with the server's true values, in the JSON types the gateway parses;
/health_generate answering 200 only after a real 1-token generation, 503 when the engine fails it, when a step holds it
past the bound (a gated step, not a slow one) and when the engine is dead."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import httpx
import pytest

from openk3.api.routes import health_generate
from openk3.serve.engine import LLMEngine
from openk3.serve.loading import ASSETS
from tests.api.conftest import MAX_MODEL_LEN, MAX_NUM_SEQS, NUM_PAGES, PAGE_SIZE, GatedStep, LiveServer, start_server, stop_server


@pytest.fixture(scope="module")
def live(torch_one_thread) -> Iterator[LiveServer]:
    server = start_server(api_key="sk-test")
    yield server
    stop_server(server)


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
def test_server_info_reports_the_running_servers_settings(http: httpx.Client, path: str) -> None:
    r = http.get(path)  # outside /v1: no API key, like /health
    assert r.status_code == 200, r.text
    assert r.json() == {
        "model_path": "debug",  # a preset built from its seed has no folder: the name --model was given
        "served_model_name": "debug",
        "version": http.get("/version").json()["version"],
        "context_length": MAX_MODEL_LEN,
        "max_running_requests": MAX_NUM_SEQS,
        "max_total_tokens": NUM_PAGES * PAGE_SIZE,
        "max_prefill_tokens": 512,
        "page_size": PAGE_SIZE,
        "enable_prefix_caching": False,
        "disaggregation_mode": "null",
    }


def test_server_info_leaves_dp_size_out_so_a_dp_aware_router_refuses_the_worker(http: httpx.Client) -> None:
    assert "dp_size" not in http.get("/server_info").json()


@pytest.mark.parametrize("path", ["/model_info", "/get_model_info"])
def test_model_info_of_a_preset_without_checkpoint(http: httpx.Client, path: str) -> None:
    r = http.get(path)
    assert r.status_code == 200, r.text
    assert r.json() == {"model_path": "debug", "is_generation": True, "max_context_length": MAX_MODEL_LEN}


def test_model_info_of_a_checkpoint_folder_names_it_and_its_config(live: LiveServer, http: httpx.Client) -> None:
    # the same app, told its weights came from the shipped tiny checkpoint: model_path becomes that folder (where a router
    # can load the tokenizer), and model_type / architectures are what its config.json says
    app_state = live.app.state  # type: ignore[attr-defined]
    state = app_state.server
    app_state.server = dataclasses.replace(state, config=dataclasses.replace(state.config, model=dataclasses.replace(state.config.model, root="tiny")))
    try:
        body = http.get("/model_info").json()
        server_model_path = http.get("/server_info").json()["model_path"]
    finally:
        app_state.server = state
    folder = str((ASSETS / "tiny").resolve())
    assert body == {
        "model_path": folder,
        "is_generation": True,
        "max_context_length": MAX_MODEL_LEN,
        "model_type": "kimi_k3",  # the demo folder is multimodal (a vision tower): K3's top-level config, not its text_config
        "architectures": ["KimiK3ForConditionalGeneration"],
    }
    assert server_model_path == folder


def test_health_generate_runs_one_token_and_frees_everything(live: LiveServer, http: httpx.Client) -> None:
    before = live.in_loop(live.frontend.call(lambda e: e.stats().generation_tokens_total))
    r = http.get("/health_generate")
    assert r.status_code == 200, r.text
    after = live.in_loop(live.frontend.call(lambda e: e.stats().generation_tokens_total))
    assert after == before + 1  # a real token came out of the engine
    live.check_idle_and_free()


def _raise_on_step(engine: LLMEngine) -> None:
    def broken_step() -> list:
        raise RuntimeError("the device is gone")

    engine.step = broken_step  # type: ignore[method-assign]  # the test injects the failure on purpose


def test_health_generate_is_503_when_the_generation_fails(torch_one_thread) -> None:
    live = start_server(before_start=_raise_on_step)
    try:
        with httpx.Client(base_url=live.base_url, timeout=60) as client:
            assert client.get("/health").status_code == 200  # nothing has run a step yet: the liveness probe cannot tell
            r = client.get("/health_generate")
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert error["type"] == "service_unavailable_error" and error["code"] == "unavailable"
            assert "the device is gone" in error["message"]
            assert client.get("/health_generate").status_code == 503  # the engine is dead now: answered at once
    finally:
        stop_server(live)


def test_health_generate_is_503_when_a_step_holds_it_past_the_bound(torch_one_thread, monkeypatch: pytest.MonkeyPatch) -> None:
    gates: list[GatedStep] = []
    live = start_server(before_start=lambda engine: gates.append(GatedStep(engine, before=True)))
    # the held step cannot end before the gate opens, so a bound of 50 ms is passed for certain, whatever the machine's speed
    monkeypatch.setattr(health_generate, "HEALTH_GENERATE_TIMEOUT_S", 0.05)
    try:
        with httpx.Client(base_url=live.base_url, timeout=60) as client:
            r = client.get("/health_generate")
            assert r.status_code == 503, r.text
            assert r.json()["error"]["message"] == "the engine produced no token within 0.05 s"
            gates[0].release.set()
            live.check_idle_and_free()  # the timed-out probe was aborted: its page and state slot are free again
            monkeypatch.setattr(health_generate, "HEALTH_GENERATE_TIMEOUT_S", 20.0)
            assert client.get("/health_generate").status_code == 200
    finally:
        gates[0].release.set()
        stop_server(live)
