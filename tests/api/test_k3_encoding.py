"""Kimi K3's encoding (openk3/api/k3_encoding.py) against renderings of the published `encoding_k3.py`
(tests/api/data/k3_encoding_reference.json, written by tests/api/data/k3_encoding_reference.py, which records its source)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from openk3.api.chat import ChatOptions
from openk3.api.chat_k3 import K3Template
from openk3.api.chat_loading import load_chat_template
from openk3.api.k3_encoding import k3_options
from openk3.api.protocol import ChatMessage
from openk3.serve.loading import ASSETS

REFERENCE = json.loads((Path(__file__).parent / "data" / "k3_encoding_reference.json").read_text())
CASES = {case["name"]: case for case in REFERENCE["cases"]}


def render(case: dict[str, Any]) -> Any:
    kwargs = dict(case["kwargs"])
    add_generation_prompt = kwargs.pop("add_generation_prompt", True)
    options = ChatOptions(kwargs.pop("reasoning_effort", None), kwargs.pop("tool_choice", None), kwargs.pop("response_format", None))
    messages = [ChatMessage.model_validate(m) for m in case["messages"]]
    return K3Template("test").render_prompt(messages, add_generation_prompt, extra=kwargs, tools=case.get("tools"), options=options)


def test_the_reference_has_enough_varied_cases_and_says_where_it_came_from():
    assert len(CASES) >= 10
    assert "encoding_k3.py" in REFERENCE["source"] and len(REFERENCE["sha256"]) == 64


@pytest.mark.parametrize("name", sorted(CASES))
def test_renders_as_the_published_encoding(name):
    case = CASES[name]
    prompt = render(case)
    assert prompt.text == case["text"]
    # every text segment is request-text-like (never a special token) and each is its own piece, as the release encodes it
    plain = [prompt.text[a:b] for a, b in prompt.plain]
    assert plain == [text for text, control in case["segments"] if not control]


def test_the_demo_model_and_k3_folders_are_served_by_this_encoding(tmp_path):
    assert isinstance(load_chat_template(ASSETS / "tiny"), K3Template)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k3"}))
    assert isinstance(load_chat_template(tmp_path), K3Template)
    other = tmp_path / "other"
    other.mkdir()
    (other / "encoding_k3.py").write_text("raise SystemExit('never run')\n")
    assert isinstance(load_chat_template(other), K3Template)


def test_an_unknown_chat_encoding_is_refused(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_encoding": "kimi_k9"}))
    with pytest.raises(ValueError, match="chat_encoding='kimi_k9'"):
        load_chat_template(tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "effort", "thinking", "effort_out"),
    [({}, None, True, "max"), ({}, "none", False, "max"), ({"thinking": False}, "high", False, "high"), ({"thinking_effort": "low"}, "high", True, "low")],
)
def test_options(kwargs, effort, thinking, effort_out):
    o = k3_options(kwargs, effort, None, None)
    assert (o.thinking, o.effort) == (thinking, effort_out)


@pytest.mark.parametrize(
    ("kwargs", "effort", "match"),
    [({"verbose": 1}, None, "chat_template_kwargs.verbose"), ({}, "medium", "'medium'"), ({"thinking": "yes"}, None, "true or false")],
)
def test_refused_options_say_why(kwargs, effort, match):
    with pytest.raises(ValueError, match=match):
        k3_options(kwargs, effort, None, None)


def test_developer_messages_are_the_systems():
    messages = [ChatMessage(role="developer", content="Be brief."), ChatMessage(role="user", content="hi")]
    text = K3Template("test").render(messages, extra={"thinking": False})
    assert text.startswith('<|open|>message role="system"<|sep|>Be brief.<|close|>message<|sep|><|end_of_msg|>')
