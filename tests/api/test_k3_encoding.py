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


def test_each_segment_is_its_own_bpe_run_as_the_release_tokenizes_it(tmp_path):
    """The ids of a K3 prompt are the segments' ids one after another (control segments as special tokens, text segments as
    plain text), as tokenization_kimi.py encodes build_chat_segments' output; encoding the text whole would merge across
    segment boundaries (` role` + `="` ...)."""
    from openk3.api.user_text import encode_prompt_text

    tok = k3_tokenizer(tmp_path)
    specials = {"<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>"}
    assert specials <= tok.special_token_strings, "the test tokenizer must have K3's markers as special tokens"
    for name in ("names_and_effort_high", "typed_arguments_history", "arguments_not_json_and_markers_in_text"):
        case = CASES[name]
        expected = [i for text, control in case["segments"] for i in (tok.encode(text) if control else tok.encode_ordinary(text))]
        assert encode_prompt_text(tok, render(case)) == expected


def k3_tokenizer(folder: Path) -> Any:
    """tests/serve/test_kimi_tokenizer.py's small Kimi tokenizer with K3's special tokens at K3's offsets (163584 + 0..5 in
    the release, spec/serving.md): [BOS], [EOS], <|end_of_msg|>, <|open|>, <|close|>, <|sep|>."""
    from openk3.serve.kimi_tokenizer import KimiTokenizer
    from tests.serve.test_kimi_tokenizer import write_kimi_tokenizer

    write_kimi_tokenizer(folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    n = min(int(k) for k in config["added_tokens_decoder"])  # the first special id: [BOS]
    k3 = {0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>"}
    config["added_tokens_decoder"] = {str(n + i): {"content": c, "special": True} for i, c in k3.items()}
    config.pop("additional_special_tokens", None)
    config_file.write_text(json.dumps(config))
    return KimiTokenizer(folder)


def test_a_forced_call_writes_each_marker_as_one_token(tmp_path):
    """tool_choice named: the call grammar lets the model write K3's markers as the special tokens they are (the server's
    call_grammars vocabulary), so `{"city": "Paris"}` costs the tokens the model would spend, not the markers spelled out
    byte by byte (what a grammar over the plain vocabulary allows, and all it allows)."""
    xgr = pytest.importorskip("xgrammar")
    from openk3.api.chat_format import CALL_MARKUP, ChatFormat
    from openk3.api.protocol import Tool
    from openk3.api.tool_choice import ToolPlan
    from openk3.serve.structured.compiler import GrammarCompiler

    tok = k3_tokenizer(tmp_path)
    weather = Tool.model_validate(
        {
            "type": "function",
            "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
        }
    )
    call = ToolPlan(ChatFormat.KIMI_K3, (weather,), frozenset({"get_weather"}), forced="get_weather").call_grammar(0)
    assert call is not None
    reply = '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>'
    as_tokens, spelled = tok.encode(reply), tok.encode_ordinary(reply)

    def accepts(compiler: GrammarCompiler, ids: list[int]) -> bool:
        matcher = xgr.GrammarMatcher(compiler.compile(call).compiled)
        return all(matcher.accept_token(i) for i in ids) and matcher.is_terminated() is False and matcher.accept_token(tok.eos_token_id)

    markup = GrammarCompiler(tok, tok.vocab_size, markup=CALL_MARKUP[ChatFormat.KIMI_K3])
    plain = GrammarCompiler(tok, tok.vocab_size)
    assert accepts(markup, as_tokens) and not accepts(plain, as_tokens)
    assert accepts(plain, spelled) and accepts(markup, spelled)
    assert len(as_tokens) < len(spelled)
    print(f"forced call of get_weather(city=Paris): {len(as_tokens)} tokens with marker tokens, {len(spelled)} spelled out")
