"""JSON booleans are not integers: a `true` token id, n or max_tokens is a 400 naming the field, not a silent 1."""

from __future__ import annotations

import httpx
import pytest

CASES = [
    ("/v1/completions", {"prompt": [True, 104]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": True}, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [False]}, "stop_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": True}, "max_completion_tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
]


@pytest.mark.parametrize("route, body, param", CASES)
def test_booleans_are_refused_as_integers(live, http: httpx.Client, route: str, body: dict, param: str) -> None:
    r = http.post(route, json={"model": "debug", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_stream_options_needs_stream(live, http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": "debug", "prompt": "hi", "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
