"""`priority`, `user` and `cache_salt` over HTTP: priority is a 400 naming --scheduling-policy under fcfs and honoured under
priority / fair; `user` (or `safety_identifier`) is the fair policy's client; cache_salt keeps cached prefixes apart
(usage.prompt_tokens_details.cached_tokens shows the hits)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from openk3.api.engine_job import sampling_params
from openk3.api.protocol import ChatCompletionRequest
from tests.api.conftest import LiveServer, start_server, stop_server
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
    assert cached(prompt) == 0
    assert cached(prompt + " and more") > 0  # and hits as before
    fair.in_loop(fair.frontend.call(lambda e: e.check_integrity()))  # the cache keeps the salted prefixes: pages stay held
