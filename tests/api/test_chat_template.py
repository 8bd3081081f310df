"""Chat templates: the ChatML default, templates shipped in a model folder, content parts, the sandbox."""

from __future__ import annotations

import json

import pytest

from openk3.api.chat import CHATML_END, ChatTemplate
from openk3.api.chat_format import ChatFormat
from openk3.api.chat_loading import load_chat_template
from openk3.api.engine_job import sampling_params
from openk3.api.protocol import ChatCompletionRequest, ChatMessage
from openk3.serve.generation_config import read_generation_config
from openk3.serve.loading import ASSETS
from openk3.serve.tokenizer import ByteTokenizer, HFTokenizer


def msgs(*pairs) -> list[ChatMessage]:
    return [ChatMessage(role=r, content=c) for r, c in pairs]


def test_default_is_chatml_with_its_end_marker_as_stop() -> None:
    t = ChatTemplate.default()
    text = t.render(msgs(("system", "S"), ("user", "U")))
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert t.render(msgs(("user", "U")), add_generation_prompt=False) == "<|im_start|>user\nU<|im_end|>\n"
    assert t.end_of_turn == CHATML_END
    assert t.stops(ByteTokenizer(256)) == ((CHATML_END,), ())  # bytes: the marker is text, so a stop string


def test_model_folder_template_is_preferred(tmp_path) -> None:
    assert load_chat_template(tmp_path).origin == ChatTemplate.default().origin
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"}))
    t = load_chat_template(tmp_path)
    assert t.render(msgs(("user", "a"), ("assistant", "b"))) == "[user]a[assistant]b" and t.end_of_turn is None
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0].content }}{% if add_generation_prompt %}>{% endif %}")
    t = load_chat_template(tmp_path)
    assert t.render(msgs(("user", "q")), special_tokens={"bos_token": "<s>"}) == "<s>q>"
    explicit = tmp_path / "other.jinja"
    explicit.write_text("X")
    assert load_chat_template(tmp_path, explicit).render(msgs(("user", "q"))) == "X"
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(tmp_path, tmp_path / "missing.jinja")


def test_named_templates_in_tokenizer_config(tmp_path) -> None:
    entry = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": entry}))
    assert load_chat_template(tmp_path).render(msgs(("user", "q"))) == "D"


def test_text_parts_are_joined_and_others_refused() -> None:
    t = ChatTemplate.default()
    m = ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]})
    assert "user\nab<|im_end|>" in t.render([m])
    bad = ChatMessage.model_validate({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]})
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\].*image_url"):
        t.render([bad])


def test_template_errors_and_sandbox_are_value_errors() -> None:
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}", "test")
    raising = ChatTemplate("{{ raise_exception('only user turns') }}", "test")
    with pytest.raises(ValueError, match="only user turns"):
        raising.render(msgs(("user", "q")))
    escape = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", "test")
    with pytest.raises(ValueError):
        escape.render(msgs(("user", "q")))


def test_end_of_turn_is_a_stop_token_when_the_tokenizer_has_it(tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([CHATML_END])
    tok.save(str(tmp_path / "tokenizer.json"))
    assert ChatTemplate.default().stops(HFTokenizer(tmp_path)) == ((), (2,))


def test_generation_config_end_tokens_join_every_request_unless_ignore_eos(tmp_path) -> None:
    def generation_stop_ids(folder):
        return read_generation_config(folder).eos_token_ids

    assert generation_stop_ids(tmp_path) == () and generation_stop_ids(None) == ()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert generation_stop_ids(tmp_path) == (5, 7)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert generation_stop_ids(tmp_path) == (3,)
    req = ChatCompletionRequest(messages=[ChatMessage(role="user", content="q")], stop_token_ids=[1])
    assert sampling_params(req, 8, None, extra_stop=("</s>",), extra_stop_ids=(3,)).stop_token_ids == (1, 3)
    assert sampling_params(req, 8, None, extra_stop=("</s>",), extra_stop_ids=(3,)).stop == ("</s>",)
    ignoring = req.model_copy(update={"ignore_eos": True})
    assert sampling_params(ignoring, 8, None, extra_stop_ids=(3,)).stop_token_ids == (1,)


def test_every_end_of_turn_marker_stops_and_kimi_formats_are_recognised() -> None:
    both = ChatTemplate("{{ '<|im_end|>' }}{{ '<|end_of_msg|>' }}", "test")
    assert both.stops(ByteTokenizer(256)) == (("<|im_end|>", "<|end_of_msg|>"), ())
    tiny = load_chat_template(ASSETS / "tiny")
    assert tiny.format is ChatFormat.KIMI_K3 and tiny.end_of_turn_markers == ("<|end_of_msg|>",) and tiny.uses_tools
    assert ChatTemplate.default().format is None and not ChatTemplate.default().uses_tools


def test_tojson_is_plain_json_and_kwargs_must_be_read_by_the_template() -> None:
    t = ChatTemplate("{{ tools | tojson }}{% if thinking %}T{% endif %}", "test")
    assert t.render(msgs(("user", "q")), tools=[{"d": "<a & b>"}]) == '[{"d": "<a & b>"}]'  # Jinja's own would escape <, & for HTML
    t.check_kwargs({"thinking": True})
    with pytest.raises(ValueError, match="enable_thinking is not read"):
        t.check_kwargs({"enable_thinking": True})
    with pytest.raises(ValueError, match="set by the server"):
        t.check_kwargs({"messages": []})


def test_tool_history_reaches_the_template() -> None:
    t = ChatTemplate(
        "{% for m in messages %}{{ m.role }}:{{ m.content }}|{{ m.reasoning_content }}|"
        "{% for c in m.tool_calls or [] %}{{ c.id }}={{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
        "{{ m.tool_call_id }}>{{ m.name }};{% endfor %}",
        "test",
    )
    call = {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}
    history = [
        ChatMessage(role="user", content="q"),
        ChatMessage.model_validate({"role": "assistant", "content": None, "reasoning_content": "r", "tool_calls": [call]}),
        ChatMessage(role="tool", tool_call_id="c1", content="sunny"),
    ]
    assert t.render(history) == "user:q||>;assistant:|r|c1=w(Oslo)>;tool:sunny||c1>w;"
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_call_id 'zz' answers no tool call"):
        t.render([ChatMessage(role="user", content="q"), ChatMessage(role="tool", tool_call_id="zz", content="x")])
