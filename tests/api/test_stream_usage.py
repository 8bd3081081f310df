"""`stream_options.continuous_usage_stats` (vLLM's, what guidellm sends): every chunk carries its choice's usage so far."""

from __future__ import annotations

import json

import httpx
import pytest

PROMPT = "The quick brown fox"
BOTH = {"include_usage": True, "continuous_usage_stats": True}


def events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_every_chunk_counts_its_choice_so_far(http, path) -> None:
    body = {"model": "debug", "max_tokens": 6, "temperature": 0, "n": 2, "stream": True, "stream_options": BOTH}
    body |= {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": PROMPT}]}
    chunks = events(http, path, body)
    *choice_chunks, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 12  # the final chunk: both choices
    prompt_tokens = last["usage"]["prompt_tokens"]
    seen: dict[int, int] = {}
    for c in choice_chunks:
        (choice,) = c["choices"]
        u = c["usage"]
        assert u["prompt_tokens"] == prompt_tokens and u["total_tokens"] == prompt_tokens + u["completion_tokens"]
        assert u["completion_tokens"] >= seen.get(choice["index"], 0)  # never goes back
        seen[choice["index"]] = u["completion_tokens"]
    assert seen == {0: 6, 1: 6}


def test_without_it_chunks_carry_no_usage(http) -> None:
    body = {"model": "debug", "prompt": PROMPT, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    *choice_chunks, last = events(http, "/v1/completions", body)
    assert all(c.get("usage") is None for c in choice_chunks) and last["usage"]["completion_tokens"] == 3


def test_the_flag_alone_still_counts_every_chunk(http) -> None:
    body = {"model": "debug", "prompt": PROMPT, "max_tokens": 3, "stream": True, "stream_options": {"continuous_usage_stats": True}}
    chunks = events(http, "/v1/completions", body)
    assert all(c["choices"] for c in chunks)  # no final usage chunk: include_usage was not asked for
    assert chunks[-1]["usage"]["completion_tokens"] == 3
