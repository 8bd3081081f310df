"""No silent ignoring: a field the server does not honour is a 400 naming it; the documented no-op fields are accepted."""

from __future__ import annotations

import pytest

from tests.api.test_bad_input import OK_CHAT, OK_COMPLETION, error_of, post

REFUSED = [
    ("/v1/completions", {**OK_COMPLETION, "frobnicate": True}, "frobnicate"),
    ("/v1/completions", {**OK_COMPLETION, "response_format": {"type": "text"}}, "response_format"),
    ("/v1/chat/completions", {**OK_CHAT, "reasoning_effort": "low"}, "reasoning_effort"),
    ("/v1/chat/completions", {**OK_CHAT, "functions": []}, "functions"),
    ("/v1/chat/completions", {**OK_CHAT, "store": True}, "store"),
    ("/v1/chat/completions", {**OK_CHAT, "service_tier": "flex"}, "service_tier"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "user", "content": "hi", "cache_control": {}}]}, "messages"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {}}]}]}, "messages"),
    ("/v1/chat/completions", {**OK_CHAT, "chat_template_kwargs": {"thinking": False}}, "chat_template_kwargs"),  # ChatML reads no kwargs
    ("/v1/chat/completions", {**OK_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),  # ChatML renders no tools
    ("/tokenize", {"prompt": "a", "frobnicate": 1}, "frobnicate"),
]


@pytest.mark.parametrize(("path", "body", "param"), REFUSED, ids=[p for _, _, p in REFUSED])
def test_a_field_not_honoured_is_a_400_naming_it(http, path, body, param) -> None:
    err = error_of(post(http, path, body), 400)
    assert err["param"] == param, err


NOOPS = {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto", "safety_identifier": "s", "prompt_cache_key": "p"}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_documented_noops_are_accepted(http, path) -> None:
    body = {**(OK_COMPLETION if path == "/v1/completions" else OK_CHAT), **NOOPS}
    assert post(http, path, body).status_code == 200


def test_tools_with_tool_choice_none_need_no_parser(http) -> None:
    body = {**OK_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}
    assert post(http, "/v1/chat/completions", body).status_code == 200
