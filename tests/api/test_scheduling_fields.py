"""`priority`, `user` and `cache_salt` over HTTP: priority is a 400 naming --scheduling-policy under fcfs and honoured under
priority / fair; `user` (or `safety_identifier`) is the fair policy's client; cache_salt keeps cached prefixes apart
(usage.prompt_tokens_details.cached_tokens shows the hits)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from openk3.api.engine_job import sampling_params
from openk3.api.protocol import ChatCompletionRequest
from tests.api.conftest import GatedStep, LiveServer, start_server, stop_server
from tests.api.test_bad_input import OK_CHAT, OK_COMPLETION, error_of, post


@pytest.fixture(scope="module")
def fair(torch_one_thread) -> Iterator[LiveServer]:
    server = start_server(scheduling_policy="fair", enable_prefix_caching=True, prefix_match_unit=8)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def fair_http(fair: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fair.base_url, timeout=60) as client:
        yield client


def test_priority_under_fcfs_names_the_flag(http) -> None:
    err = error_of(post(http, "/v1/completions", {**OK_COMPLETION, "priority": -1}), 400)
    assert err["param"] == "priority" and "--scheduling-policy priority" in err["message"]


def test_priority_is_served_under_the_fair_policy(fair_http) -> None:
    for priority in (-5, 0, 7):
        assert post(fair_http, "/v1/chat/completions", {**OK_CHAT, "priority": priority, "user": "alice"}).status_code == 200


def test_user_names_the_client() -> None:
    def client(**fields) -> str | None:
        return sampling_params(ChatCompletionRequest.model_validate({**OK_CHAT, **fields}), 2, None).client

    assert (client(), client(user="alice"), client(safety_identifier="s1"), client(user="alice", safety_identifier="s1")) == (None, "alice", "s1", "alice")


def test_cache_salt_keeps_prefixes_apart(fair: LiveServer, fair_http) -> None:
    prompt = "The salted prefix cache keeps tenants apart: " * 3

    def cached(text: str, **fields) -> int:
        r = post(fair_http, "/v1/completions", {**OK_COMPLETION, "prompt": text, "temperature": 0, **fields})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(prompt, cache_salt="a") == 0
    assert cached(prompt + "more", cache_salt="a") > 0  # the first prompt's end state, under the same salt
    assert cached(prompt + "more", cache_salt="b") == 0
    assert cached(prompt + "more") == 0  # no salt is a salt of its own: salted states are not its
    assert cached(prompt) > 0  # the unsalted request just before took states inside its prompt (match-unit multiples)
    assert cached(prompt + " and more") > 0  # and hits as before
    fair.in_loop(fair.frontend.call(lambda e: e.check_integrity()))  # the cache keeps the salted prefixes: pages stay held


class ProbeLog:
    """Wraps the engine's step (engine thread): the step number at which the probe client's request was first present
    before a step, and the one that first scheduled it. Steps, not time: the order of events is the engine's own."""

    def __init__(self, engine) -> None:
        self.engine, self.step, self.steps = engine, engine.step, 0
        self.present: int | None = None
        self.scheduled: int | None = None
        engine.step = self

    def __call__(self):
        self.steps += 1
        probe = next((r for r in self.engine.scheduler.requests.values() if r.sampling_params.client == "probe"), None)
        if probe is not None and self.present is None:
            self.present = self.steps
        out = self.step()
        if probe is not None and self.scheduled is None and probe.timings.first_scheduled is not None:
            self.scheduled = self.steps
        return out


def probe_delay(policy: str) -> int:
    """One client's 4 requests of 60 tokens over 2 slots, then another client's 2-token request: the steps it waited."""
    gates: list[GatedStep] = []
    logs: list[ProbeLog] = []

    def hook(engine) -> None:
        gates.append(GatedStep(engine))  # held after the step that scheduled the first flood request
        logs.append(ProbeLog(engine))

    live = start_server(scheduling_policy=policy, max_num_seqs=2, before_start=hook)
    gate, log = gates[0], logs[0]
    results: dict[str, httpx.Response] = {}

    def send(name: str, user: str, max_tokens: int) -> None:
        body = {**OK_COMPLETION, "prompt": name, "max_tokens": max_tokens, "ignore_eos": True, "user": user}
        results[name] = httpx.post(live.base_url + "/v1/completions", json=body, timeout=120)

    try:
        threads = []
        for i, (name, user, n) in enumerate([("a0", "flood", 60), ("a1", "flood", 60), ("a2", "flood", 60), ("a3", "flood", 60), ("p", "probe", 2)]):
            threads.append(threading.Thread(target=send, args=(name, user, n)))
            threads[-1].start()
            if i == 0:
                assert gate.entered.wait(30)  # a0 runs and the engine is held
                continue
            deadline = time.monotonic() + 30  # a bound on a hang, not a race: the order is the queue's
            while live.frontend.num_active < i + 1 and time.monotonic() < deadline:
                time.sleep(0.005)
        gate.release.set()
        for t in threads:
            t.join(120)
        assert all(r.status_code == 200 for r in results.values())
        live.in_loop(live.frontend.call(lambda e: e.check_integrity()))
    finally:
        gate.release.set()
        stop_server(live)
    assert log.present is not None and log.scheduled is not None
    return log.scheduled - log.present


def test_a_flood_does_not_hold_back_another_clients_request(torch_one_thread) -> None:
    """fcfs admits a1 and queues a2, a3 and the probe in arrival order: the probe gets a slot only once a0 and a1, and then
    a2 or a3, have run their 60 tokens (about 120 steps). fair admits it in the first step it is there (its client runs
    nothing; the flood's runs one)."""
    assert probe_delay("fair") == 0
    assert probe_delay("fcfs") >= 100
