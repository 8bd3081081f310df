"""vLLM's and OpenAI's fields that clients send as a matter of course: honoured (logit_bias, allowed_token_ids, bad_words,
truncate_prompt_tokens, reasoning_effort / verbosity where the template reads them, cache_salt; priority and user under the
priority and fair policies: tests/api/test_scheduling_fields.py), accepted where they cannot change the answer (annotations,
audio and refusal as null in messages, modalities ["text"], priority 0 under fcfs), and a 400 naming them otherwise."""

from __future__ import annotations

import pytest

from openk3.api.chat import ChatTemplate
from openk3.api.errors import APIError
from openk3.api.jobs import verbosity_kwargs
from openk3.api.protocol import ChatCompletionRequest
from openk3.serve.token_rules import banned_by_bad_words
from tests.api.test_bad_input import OK_CHAT, OK_COMPLETION, error_of, post

GREEDY = {**OK_COMPLETION, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}


def text_of(http, body: dict) -> str:
    r = post(http, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


ACCEPTED = [
    {**OK_CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "annotations": None, "audio": None, "refusal": None}]},
    {**OK_CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "annotations": [{"type": "url_citation"}]}]},
    {**OK_CHAT, "modalities": ["text"]},
    {**OK_CHAT, "priority": 0, "user": "u"},
    {**OK_CHAT, "cache_salt": "tenant-1"},
]


@pytest.mark.parametrize("body", ACCEPTED)
def test_accepted(http, body) -> None:
    assert post(http, "/v1/chat/completions", body).status_code == 200


REFUSED = [
    ({**OK_CHAT, "reasoning_effort": "low"}, "reasoning_effort"),  # ChatML reads no reasoning_effort
    ({**OK_CHAT, "verbosity": "low"}, "verbosity"),
    ({**OK_CHAT, "modalities": ["text", "audio"]}, "modalities"),
    ({**OK_CHAT, "priority": 1}, "priority"),  # the test server runs fcfs
    ({**OK_CHAT, "messages": [{"role": "assistant", "content": "a", "audio": {"id": "x"}}]}, "messages"),
    ({**OK_CHAT, "logit_bias": {"abc": 1}}, "logit_bias"),
    ({**OK_CHAT, "logit_bias": {"65": 101}}, "logit_bias"),
    ({**OK_CHAT, "allowed_token_ids": []}, "allowed_token_ids"),
]


@pytest.mark.parametrize(("body", "param"), REFUSED, ids=[p for _, p in REFUSED])
def test_refused_naming_the_field(http, body, param) -> None:
    assert error_of(post(http, "/v1/chat/completions", body), 400)["param"] == param


def test_logit_bias_and_allowed_token_ids_are_honoured(http) -> None:
    assert text_of(http, {**GREEDY, "logit_bias": {str(ord("Q")): 100}}) == "Q" * 8
    allowed = [ord("a"), ord("b")]
    assert set(text_of(http, {**GREEDY, "allowed_token_ids": allowed})) <= {"a", "b"}


def test_bad_words_are_never_written(http) -> None:
    letters = {**GREEDY, "allowed_token_ids": [ord(c) for c in "abc"]}  # printable choices, so the banned one is one token
    banned = text_of(http, letters)[0]
    assert banned not in text_of(http, {**letters, "bad_words": [banned]})
    assert banned_by_bad_words([(1, 2, 3)], [5, 1, 2]) == [3] and banned_by_bad_words([(1, 2, 3)], [1]) == []


def test_truncate_prompt_tokens_keeps_the_end(http) -> None:
    r = post(http, "/v1/completions", {**GREEDY, "max_tokens": 1, "echo": True, "truncate_prompt_tokens": 5})
    assert r.json()["usage"]["prompt_tokens"] == 5 and r.json()["choices"][0]["text"].startswith("n fox")


def test_verbosity_reaches_a_template_that_reads_it() -> None:
    def req(**fields) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate({**OK_CHAT, **fields})

    reads = ChatTemplate("{{ verbosity }}{{ messages }}", "test")
    assert verbosity_kwargs(req(verbosity="low"), reads) == {"verbosity": "low"}
    assert verbosity_kwargs(req(chat_template_kwargs={"x": 1}), reads) == {"x": 1}
    with pytest.raises(APIError, match="does not read verbosity"):  # reasoning_effort is the renderers' (test_k3_encoding)
        verbosity_kwargs(req(verbosity="low"), ChatTemplate("{{ messages }}", "test"))
