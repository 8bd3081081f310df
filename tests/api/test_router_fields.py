"""Request bodies as sglang-router forwards them are served (api/protocol.py ROUTER_FIELDS): the SGLang-only fields it adds
are accepted at the values that mean what openk3 does, `no_stop_trim: true` keeps the stop string, chat's
`max_completion_tokens` (the router's rewrite of `max_tokens`) bounds the reply, and every other value is a 400 naming
the field and saying why.

The bodies are reconstructed from sglang-router 0.3.0-0.3.2 (the sgl-model-gateway sources of those releases, unchanged
between them): src/protocols/completion.rs and src/protocols/chat.rs declare the request structs; src/routers/http/
router.rs (send_typed_request) posts the parsed struct re-serialised with serde, so every field without
`skip_serializing_if` is sent at its serde default whether the client set it or not, in declaration order; chat bodies go
through src/protocols/validated.rs first, whose `normalize` moves `max_tokens` into `max_completion_tokens`. A live run
(sglang-router 0.3.2 from pip in front of two `openk3 serve --model debug`, bodies captured between them) forwarded these
bodies byte for byte.
"""

from __future__ import annotations

import json

import httpx
import pytest

from openk3.api.protocol import ROUTER_FIELDS, ChatCompletionRequest, CompletionRequest
from tests.api.test_bad_input import error_of, post

# openai client: completions.create(model="debug", prompt="hi", max_tokens=2, temperature=0), as the router forwards it
COMPLETION = {
    "model": "debug",
    "prompt": "hi",
    "max_tokens": 2,
    "temperature": 0.0,
    "stream": False,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}
# openai client: chat.completions.create(model="debug", messages=[...], max_tokens=2, temperature=0), as the router forwards it
CHAT = {
    "messages": [{"role": "user", "content": "hi"}],
    "model": "debug",
    "logprobs": False,
    "max_completion_tokens": 2,
    "stream": False,
    "temperature": 0.0,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
MULTI_TURN = {
    **CHAT,
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
    ],
}
STREAM = {"stream": True, "stream_options": {"include_usage": True}}
ACCEPTED = {
    "completion": ("/v1/completions", COMPLETION),
    "completion stream": ("/v1/completions", {**COMPLETION, **STREAM}),
    "chat": ("/v1/chat/completions", CHAT),
    "chat stream": ("/v1/chat/completions", {**CHAT, **STREAM}),
    "chat multi-turn": ("/v1/chat/completions", MULTI_TURN),
}


def events(r: httpx.Response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_the_router_fields_are_the_sglang_fields_these_bodies_carry() -> None:
    sglang = {"no_stop_trim", "return_hidden_states", "continue_final_message", "separate_reasoning", "stream_reasoning"}
    assert set(ROUTER_FIELDS) == sglang and sglang <= set(CHAT) and sglang <= set(ChatCompletionRequest.model_fields)
    assert {f for f in sglang if f in COMPLETION} == {f for f in sglang if f in CompletionRequest.model_fields}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_bodies_the_router_forwards_are_served(http: httpx.Client, name: str) -> None:
    path, body = ACCEPTED[name]
    r = post(http, path, body)
    assert r.status_code == 200, r.text
    if body["stream"]:
        chunks = events(r)
        assert "error" not in chunks[-1] and chunks[-1]["usage"]["completion_tokens"] <= 2
    else:
        assert r.json()["usage"]["completion_tokens"] <= 2


def test_max_completion_tokens_bounds_a_chat_reply(http: httpx.Client) -> None:
    r = post(http, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["completion_tokens"] == 5 and out["choices"][0]["finish_reason"] == "length"


def test_max_completion_tokens_past_the_context_is_a_400_naming_it(http: httpx.Client) -> None:
    err = error_of(post(http, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 10**6}), 400)
    assert err["param"] == "max_completion_tokens" and err["code"] == "context_length_exceeded"


def _greedy_stop(http: httpx.Client) -> tuple[str, str]:
    """A greedy completion's text and a stop string in it: its first ASCII letter or digit (after the first character)."""
    r = post(http, "/v1/completions", {**COMPLETION, "max_tokens": 12, "ignore_eos": True})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    stop = next(c for c in text[1:] if c.isascii() and c.isalnum())
    return text, stop


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_no_stop_trim_keeps_the_stop_string(http: httpx.Client, stream: bool) -> None:
    text, stop = _greedy_stop(http)
    cut = text.index(stop)
    for keep, expected in ((False, text[:cut]), (True, text[: cut + len(stop)])):
        body = {**COMPLETION, "max_tokens": 12, "ignore_eos": True, "stop": [stop], "no_stop_trim": keep, "stream": stream}
        r = post(http, "/v1/completions", body)
        assert r.status_code == 200, r.text
        if stream:
            chunks = events(r)
            got, reason = "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]
        else:
            got, reason = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
        assert (got, reason) == (expected, "stop"), keep


# each router field at the value openk3 does not honour; the router sends the other one unless the client asks
REFUSED = [
    ("/v1/completions", COMPLETION, "return_hidden_states", True, "only false"),
    ("/v1/chat/completions", CHAT, "return_hidden_states", True, "only false"),
    ("/v1/chat/completions", CHAT, "continue_final_message", True, "only false"),
    ("/v1/chat/completions", CHAT, "separate_reasoning", False, "only true"),
    ("/v1/chat/completions", CHAT, "stream_reasoning", False, "only true"),
    ("/v1/chat/completions", {**CHAT, **STREAM}, "stream_reasoning", False, "only true"),
]


@pytest.mark.parametrize(("path", "body", "field", "value", "why"), REFUSED, ids=[f"{p.rsplit('/', 1)[1]}-{f}" for p, b, f, _, _ in REFUSED])
def test_a_router_field_at_a_value_not_honoured_is_a_400_naming_it(http: httpx.Client, path, body, field, value, why) -> None:
    err = error_of(post(http, path, {**body, field: value}), 400)
    assert err["param"] == field and why in err["message"], err


# SGLang fields the router forwards only when the client sets them, which openk3 does not have: still a 400 naming them
CLIENT_ONLY = [
    ("/v1/chat/completions", CHAT, "regex", "a+"),
    ("/v1/chat/completions", CHAT, "ebnf", 'root ::= "a"'),
    ("/v1/completions", COMPLETION, "json_schema", "{}"),
    ("/v1/completions", COMPLETION, "lora_path", "adapter"),
    ("/v1/chat/completions", CHAT, "session_params", {"id": "s"}),
    ("/v1/chat/completions", CHAT, "sampling_seed", 1),
]


@pytest.mark.parametrize(("path", "body", "field", "value"), CLIENT_ONLY, ids=[f for _, _, f, _ in CLIENT_ONLY])
def test_sglang_fields_openk3_lacks_stay_refused(http: httpx.Client, path, body, field, value) -> None:
    err = error_of(post(http, path, {**body, field: value}), 400)
    assert err["param"] == field, err
