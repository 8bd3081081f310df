"""Every bad input gets the right 4xx with an OpenAI error body naming the problem, and the server stays healthy."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.api.conftest import MAX_MODEL_LEN, start_server, stop_server

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
OK_COMPLETION = {"model": "debug", "prompt": "hi", "max_tokens": 2}
OK_CHAT = {"model": "debug", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def keyed(torch_one_thread):
    server = start_server(api_key=KEY)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(keyed):
    with httpx.Client(base_url=keyed.base_url, timeout=60, headers=AUTH) as c:
        yield c


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def post(client, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=content, headers={"Content-Type": "application/json"})


CASES: list[tuple[str, str, bytes | dict[str, object], int, str | None, str]] = [
    ("malformed json", "/v1/completions", b'{"model": "debug", "prompt": "hi",', 400, None, "not valid JSON"),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None, "JSON object"),
    ("wrong type", "/v1/completions", {**OK_COMPLETION, "max_tokens": "many"}, 400, "max_tokens", "max_tokens"),
    ("negative max_tokens", "/v1/completions", {**OK_COMPLETION, "max_tokens": -1}, 400, "max_tokens", "max_tokens"),
    ("temperature > 2", "/v1/completions", {**OK_COMPLETION, "temperature": 2.5}, 400, "temperature", "temperature"),
    ("top_p = 0", "/v1/chat/completions", {**OK_CHAT, "top_p": 0}, 400, "top_p", "top_p"),
    ("n = 0", "/v1/completions", {**OK_COMPLETION, "n": 0}, 400, "n", "n"),
    ("min_tokens > max_tokens", "/v1/completions", {**OK_COMPLETION, "min_tokens": 5}, 400, "min_tokens", "min_tokens"),
    ("missing prompt", "/v1/completions", {"model": "debug"}, 400, "prompt", "prompt"),
    ("empty prompt", "/v1/completions", {**OK_COMPLETION, "prompt": ""}, 400, "prompt", "empty"),
    ("token id outside vocab", "/v1/completions", {**OK_COMPLETION, "prompt": [1, 999]}, 400, "prompt", "999"),
    ("unknown model", "/v1/completions", {**OK_COMPLETION, "model": "gpt-9"}, 404, "model", "gpt-9"),
    ("unknown chat model", "/v1/chat/completions", {**OK_CHAT, "model": "gpt-9"}, 404, "model", "gpt-9"),
    ("empty messages", "/v1/chat/completions", {**OK_CHAT, "messages": []}, 400, "messages", "messages"),
    ("bad role", "/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages", "role"),
    (
        "image content",
        "/v1/chat/completions",
        {**OK_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content[0].image_url",
        "does not take images",
    ),
    ("top_logprobs without logprobs", "/v1/chat/completions", {**OK_CHAT, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    ("invalid utf-8", "/v1/completions", b'{"model": "debug", "prompt": "\xff\xfe"}', 400, None, "UTF-8"),
    ("lone surrogate", "/v1/completions", b'{"model": "debug", "prompt": "\\ud800"}', 400, None, "surrogate"),
    ("deep nesting", "/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None, "JSON"),
    ("5000-digit integer", "/v1/completions", b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", 400, None, "JSON"),
    ("huge seed", "/v1/completions", {**OK_COMPLETION, "seed": 10**30}, 400, "seed", "seed"),
    ("logit_bias key not a token id", "/v1/completions", {**OK_COMPLETION, "logit_bias": {"x": 5}}, 400, "logit_bias", "logit_bias"),
    ("detokenize outside vocab", "/detokenize", {"tokens": [5, 300]}, 400, "tokens", "300"),
]


@pytest.mark.parametrize("name, path, body, status, param, needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_an_openai_error(client, name, path, body, status, param, needle) -> None:
    err = error_of(post(client, path, body), status)
    assert needle in err["message"] or needle == err["param"]
    if param is not None:
        assert err["param"] == param
    assert client.get("/health").status_code == 200


def test_streaming_request_with_bad_input_fails_before_streaming(client) -> None:
    r = post(client, "/v1/completions", {**OK_COMPLETION, "stream": True, "temperature": -1})
    assert r.headers["content-type"].startswith("application/json")
    error_of(r, 400)


def test_context_overflow_names_limit_prompt_and_completion(client) -> None:
    err = error_of(post(client, "/v1/completions", {**OK_COMPLETION, "prompt": "x" * 200, "max_tokens": 100}), 400)
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert str(MAX_MODEL_LEN) in err["message"] and "200 in the prompt" in err["message"] and "100 for the completion" in err["message"]
    err = error_of(post(client, "/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "user", "content": "y" * 400}]}), 400)
    assert err["param"] == "messages" and str(MAX_MODEL_LEN) in err["message"]


def test_ten_megabyte_body_is_refused(client) -> None:
    body = json.dumps({**OK_COMPLETION, "prompt": "z" * 10_000_000}).encode()
    err = error_of(post(client, "/v1/completions", body), 413)
    assert "limit" in err["message"]
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}], ids=["none", "wrong", "no-scheme"])
def test_wrong_api_key_is_401(keyed, headers) -> None:
    r = httpx.post(keyed.base_url + "/v1/completions", json=OK_COMPLETION, headers=headers, timeout=30)
    assert error_of(r, 401)["code"] == "invalid_api_key"
    assert error_of(httpx.get(keyed.base_url + "/v1/models", headers=headers), 401)
    assert httpx.get(keyed.base_url + "/health").status_code == 200  # health and metrics stay open, as in vLLM


def test_unknown_fields_are_refused_not_ignored(client) -> None:  # the full rules: tests/api/test_unknown_fields.py
    r = post(client, "/v1/completions", {**OK_COMPLETION, "frobnicate": True})
    assert error_of(r, 400)["param"] == "frobnicate"


def test_unknown_route_and_method(client) -> None:
    assert error_of(client.get("/v1/nothing"), 404)
    assert error_of(client.get("/v1/completions"), 405)


def test_server_is_healthy_and_clean_afterwards(client, keyed) -> None:
    r = post(client, "/v1/completions", OK_COMPLETION)
    assert r.status_code == 200
    keyed.check_idle_and_free()
