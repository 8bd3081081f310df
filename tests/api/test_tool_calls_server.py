"""Tool calls and reasoning through the server, with the official `openai` client: a scripted model writes exact K3 replies
after the demo model's K3-style template, streamed and not; tool_choice none / auto / named / required; finish reasons."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from openk3.api.chat import ChatOptions
from openk3.api.chat_loading import load_chat_template
from openk3.api.protocol import ChatMessage
from openk3.api.served_model import ModelIdentity
from openk3.api.server import ServerConfig, create_app
from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.loading import ASSETS
from openk3.serve.tokenizer import ByteTokenizer
from tests.api.conftest import serve_app, stop_server
from tests.serve.serve_fakes import ScriptedModel

openai = pytest.importorskip("openai", reason="the openai client is the peer oracle for the wire format")

TEMPLATE = load_chat_template(ASSETS / "tiny")
TOKENIZER = ByteTokenizer(260)
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
TIME: dict[str, Any] = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "Weather in Paris and the time?"}]
CALL = '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|><|close|>call<|sep|>'
CALL2 = '<|open|>call tool="get_time" index="2"<|sep|><|close|>call<|sep|>'
END = "<|close|>message<|sep|><|end_of_msg|>"
TWO_CALLS = (
    f"I should look.<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|><|open|>tools<|sep|>{CALL}{CALL2}<|close|>tools<|sep|>{END}"
)


class Scripted:
    """A live server whose model writes `reply` after whatever prompt the template renders (the script is the prompt's
    own tokens, then the reply's); set `reply` before each request."""

    def __init__(self) -> None:
        self.model = ScriptedModel([0], vocab_size=260)
        engine = LLMEngine(self.model, TOKENIZER, EngineConfig(num_pages=512, page_size=16, max_num_seqs=4, max_model_len=4096))
        app = create_app(engine, TOKENIZER, TEMPLATE, ServerConfig(ModelIdentity("k3", "k3")))
        self.live = serve_app(app)

    def script(
        self,
        messages: list[dict],
        reply: str,
        tools: list[dict] | None = None,
        forced: str = "",
        choice: str | None = None,
        effort: str | None = None,
        **kwargs,
    ) -> None:
        """`choice`: the request's tool_choice "required" / "none", which K3's encoding writes into the prompt; `effort`: its
        reasoning_effort, which the encoding writes too."""
        options = ChatOptions(reasoning_effort=effort, tool_choice=choice)
        prompt = TEMPLATE.render([ChatMessage.model_validate(m) for m in messages], tools=tools, extra=kwargs or None, options=options) + forced
        self.model.script = TOKENIZER.encode(prompt) + TOKENIZER.encode(reply) + [0] * 8


@pytest.fixture(scope="module")
def scripted(torch_one_thread) -> Iterator[Scripted]:
    s = Scripted()
    yield s
    stop_server(s.live)


@pytest.fixture(scope="module")
def client(scripted):
    with openai.OpenAI(base_url=scripted.live.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def collect(stream) -> dict:
    """A stream put back together as a client does: reasoning, content, calls by index, the last finish reason."""
    out: dict = {"reasoning": "", "content": "", "calls": {}, "finish": None, "first_call_deltas": []}
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        out["reasoning"] += getattr(delta, "reasoning_content", None) or ""
        out["content"] += delta.content or ""
        for tc in delta.tool_calls or ():
            call = out["calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id is not None:
                out["first_call_deltas"].append((tc.index, tc.id, tc.type, tc.function.name, tc.function.arguments))
                call["id"], call["name"] = tc.id, tc.function.name
            call["arguments"] += tc.function.arguments or ""
        out["finish"] = choice.finish_reason or out["finish"]
    return out


def test_parallel_calls_with_reasoning_whole_and_streamed(scripted, client) -> None:
    scripted.script(ASK, TWO_CALLS, tools=[WEATHER, TIME])
    r = client.chat.completions.create(model="k3", messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=400)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    m = choice.message
    assert m.content == "Checking." and m.reasoning_content == "I should look."  # type: ignore[attr-defined]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c.id.startswith("call_") and c.type == "function" for c in m.tool_calls)

    s = collect(client.chat.completions.create(model="k3", messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=400, stream=True))
    assert (s["reasoning"], s["content"], s["finish"]) == ("I should look.", "Checking.", "tool_calls")
    assert [(c["name"], c["arguments"]) for _, c in sorted(s["calls"].items())] == [(c.function.name, c.function.arguments) for c in m.tool_calls]
    assert [(i, t, name, a) for i, _, t, name, a in s["first_call_deltas"]] == [(0, "function", "get_weather", ""), (1, "function", "get_time", "")]


def test_the_openai_client_puts_streamed_arguments_together(scripted, client) -> None:
    """The client's own stream accumulation (`chat.completions.stream`) gets the whole response's calls, from arguments that
    arrive in many fragments (the scripted model writes one byte a step), with increasing indexes for parallel calls."""
    scripted.script(ASK, TWO_CALLS, tools=[WEATHER, TIME])
    kwargs: dict[str, Any] = dict(model="k3", messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=400)
    whole = client.chat.completions.create(**kwargs).choices[0]
    with client.chat.completions.stream(**kwargs) as stream:
        fragments = [(e.index, e.arguments_delta) for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == whole.finish_reason == "tool_calls"
    got = [(c.function.name, c.function.arguments) for c in final.message.tool_calls or ()]
    assert got == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
    assert got == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    weather = [a for i, a in fragments if i == 0]
    assert len(weather) > 5 and "".join(weather) == '{"city": "Paris"}'  # streamed as written, not in one piece
    assert [i for i, _ in fragments] == sorted(i for i, _ in fragments)


def test_strict_tools_with_auto_let_valid_calls_through(scripted, client) -> None:
    """strict with tool_choice auto is honoured by a grammar (tests/api/test_structured_output.py checks what it refuses):
    a reply of text and valid calls passes through it token for token."""
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    scripted.script(ASK, TWO_CALLS, tools=[strict, TIME])
    kwargs: dict[str, Any] = dict(model="k3", messages=ASK, tools=[strict, TIME], tool_choice="auto", temperature=0, max_tokens=400)
    for content, calls, finish in _whole_and_streamed(client, **kwargs):
        assert (content, finish) == ("Checking.", "tool_calls")
        assert calls == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    # a call against the schema (city is a string): as written without strict, made to match it with strict
    wrong = '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="number"<|sep|>7<|close|>argument<|sep|><|close|>call<|sep|>'
    reply = f"<|close|>think<|sep|><|open|>response<|sep|>Hm.<|close|>response<|sep|><|open|>tools<|sep|>{wrong}<|close|>tools<|sep|>{END}"
    for tool, arguments in ((WEATHER, '{"city": 7}'), (strict, '{"city": "7"}')):
        scripted.script(ASK, reply, tools=[tool, TIME])
        for content, calls, finish in _whole_and_streamed(client, **{**kwargs, "tools": [tool, TIME]}):
            assert (content, calls, finish) == ("Hm.", [("get_weather", arguments)], "tool_calls")


def test_the_tool_loop_renders_calls_and_results_back(scripted, client) -> None:
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
    ]
    prompt = TEMPLATE.render([ChatMessage.model_validate(m) for m in history], tools=[WEATHER])
    assert '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris' in prompt
    assert '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>sunny' in prompt
    scripted.script(history, f"It is sunny.<|close|>think<|sep|><|open|>response<|sep|>Sunny in Paris.<|close|>response<|sep|>{END}", tools=[WEATHER])
    r = client.chat.completions.create(model="k3", messages=history, tools=[WEATHER], temperature=0, max_tokens=300)
    assert r.choices[0].message.content == "Sunny in Paris." and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.tool_calls is None


def test_thinking_off_through_chat_template_kwargs(scripted, client) -> None:
    scripted.script(ASK, f"Plain.<|close|>response<|sep|>{END}", thinking=False)
    r = client.chat.completions.create(model="k3", messages=ASK, temperature=0, max_tokens=100, extra_body={"chat_template_kwargs": {"thinking": False}})
    m = r.choices[0].message
    assert m.content == "Plain." and getattr(m, "reasoning_content", None) is None


def test_named_tool_choice_is_forced_into_the_prompt(scripted, client) -> None:
    forced = '<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="get_time" index="1"<|sep|>'
    scripted.script(ASK, f"<|close|>call<|sep|><|close|>tools<|sep|>{END}", tools=[WEATHER, TIME], forced=forced)
    choice = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model="k3", messages=ASK, tools=[WEATHER, TIME], tool_choice=choice, temperature=0, max_tokens=100)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_time"] and r.choices[0].finish_reason == "tool_calls"
    assert r.choices[0].message.content is None
    # "required" with one tool is the same call
    scripted.script(ASK, f"<|close|>call<|sep|><|close|>tools<|sep|>{END}", tools=[TIME], forced=forced, choice="required")
    r = client.chat.completions.create(model="k3", messages=ASK, tools=[TIME], tool_choice="required", temperature=0, max_tokens=100)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_time"]


def test_tool_choice_none_hides_the_tools_and_parses_nothing(scripted, client) -> None:
    scripted.script(ASK, TWO_CALLS, choice="none")  # rendered without tools, and told to call none
    r = client.chat.completions.create(model="k3", messages=ASK, tools=[WEATHER, TIME], tool_choice="none", temperature=0, max_tokens=400)
    m = r.choices[0].message
    assert m.tool_calls is None and r.choices[0].finish_reason == "stop" and m.content == "Checking."  # the tools block it wrote anyway is dropped


@pytest.mark.parametrize("stream", [False, True])
def test_a_truncated_call_comes_back_as_content_with_length(scripted, client, stream) -> None:
    reply = f"<|close|>think<|sep|><|open|>response<|sep|>Sure.<|close|>response<|sep|><|open|>tools<|sep|>{CALL}{CALL2}"
    cut = reply[: reply.index("get_time") + 4]
    scripted.script(ASK, reply + END, tools=[WEATHER, TIME])
    n = len(TOKENIZER.encode(cut))
    kwargs = dict(model="k3", messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=n)
    if stream:
        s = collect(client.chat.completions.create(**kwargs, stream=True))
        content, names, finish = s["content"], [c["name"] for c in s["calls"].values()], s["finish"]
    else:
        r = client.chat.completions.create(**kwargs)
        m = r.choices[0].message
        content, names, finish = m.content, [c.function.name for c in m.tool_calls or ()], r.choices[0].finish_reason
    assert finish == "length" and names == ["get_weather"]
    assert content == "Sure."  # the cut call's markup is dropped, never content


def _whole_and_streamed(client, **kwargs) -> list[tuple[str, list[tuple[str, str]], str]]:
    r = client.chat.completions.create(**kwargs)
    s = collect(client.chat.completions.create(**kwargs, stream=True))
    m = r.choices[0].message
    return [
        (m.content, [(c.function.name, c.function.arguments) for c in m.tool_calls or ()], r.choices[0].finish_reason),
        (s["content"], [(c["name"], c["arguments"]) for _, c in sorted(s["calls"].items())], s["finish"]),
    ]


def test_a_malformed_call_is_content_not_an_error(scripted, client) -> None:
    head = '<|open|>call tool="get_weather" index=1<|sep|>'  # unquoted attribute: caught before the call is announced
    arg = '<|open|>argument key="city" type="number"<|sep|>Paris<|close|>argument<|sep|>'  # caught after it was
    reply = "<|close|>think<|sep|><|open|>response<|sep|>Hm.<|close|>response<|sep|><|open|>tools<|sep|>{}<|close|>call<|sep|><|close|>tools<|sep|>" + END
    kwargs = dict(model="k3", messages=ASK, tools=[WEATHER], temperature=0, max_tokens=400)
    scripted.script(ASK, reply.format(head + arg), tools=[WEATHER])
    for content, calls, finish in _whole_and_streamed(client, **kwargs):
        assert not calls and finish == "stop" and content.startswith("Hm." + head + arg)
    scripted.script(ASK, reply.format(CALL[: CALL.index("<|sep|>") + 7] + arg), tools=[WEATHER])
    for content, calls, finish in _whole_and_streamed(client, **kwargs):
        # a value not of its type is kept as a string, as SGLang's K3 detector keeps it
        assert calls == [("get_weather", '{"city": "Paris"}')] and finish == "tool_calls" and content == "Hm."


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"chat_template_kwargs": {"verbose": True}}, "chat_template_kwargs"),  # K3's encoding reads no such kwarg
        ({"reasoning_effort": "medium"}, "reasoning_effort"),  # K3 takes low / high / max, or none (thinking off)
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 42}}}]}, "tools"),  # not a JSON Schema
    ],
)
def test_what_cannot_be_honoured_is_a_400(scripted, client, extra, param) -> None:
    body: dict[str, object] = {"tools": [WEATHER, TIME]}
    body.update(extra)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="k3", messages=ASK, max_tokens=5, extra_body=body)
    assert e.value.body["param"] == param  # type: ignore[index]


def test_server_is_clean_afterwards(scripted) -> None:
    live = scripted.live
    deadline = time.monotonic() + 10
    while live.in_loop(live.frontend.call(lambda e: e.has_unfinished())) and time.monotonic() < deadline:
        time.sleep(0.05)
    live.in_loop(live.frontend.call(lambda e: e.check_integrity()))


def test_tokenize_renders_messages_with_the_chat_fields_and_detokenize_spells_special_tokens(scripted) -> None:
    """/tokenize with messages takes vLLM's chat fields and returns exactly the chat route's prompt; /detokenize reads it
    back with special tokens spelled out."""
    import httpx

    body = {
        "messages": ASK,
        "tools": [WEATHER],
        "chat_template_kwargs": {"thinking": True},
        "reasoning_effort": "low",
        "add_generation_prompt": False,
    }
    r = httpx.post(scripted.live.base_url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    messages = [ChatMessage.model_validate(m) for m in ASK]
    expected = TEMPLATE.render(messages, False, extra={"thinking": True}, tools=[WEATHER], options=ChatOptions(reasoning_effort="low"))
    assert "thinking_effort=low" in expected and "tool-declare" in expected and not expected.endswith("<|open|>think<|sep|>")
    assert r.json()["tokens"] == TOKENIZER.encode(expected)
    bos = TOKENIZER.bos_token_id
    r = httpx.post(scripted.live.base_url + "/detokenize", json={"tokens": [bos, *TOKENIZER.encode("hi")]}, timeout=30)
    assert r.json()["prompt"] == "<|bos|>hi"
    for bad, param in (
        ({**body, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 42}}}]}, "tools"),
        ({**body, "reasoning_effort": "medium"}, "reasoning_effort"),
    ):
        r = httpx.post(scripted.live.base_url + "/tokenize", json=bad, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_reasoning_effort_none_turns_thinking_off_and_a_server_default_can_too(scripted, client) -> None:
    scripted.script(ASK, f"Plain.<|close|>response<|sep|>{END}", thinking=False)
    r = client.chat.completions.create(model="k3", messages=ASK, temperature=0, max_tokens=100, reasoning_effort="none")  # type: ignore[arg-type]
    m = r.choices[0].message
    assert m.content == "Plain." and getattr(m, "reasoning_content", None) is None
    app: Any = scripted.live.app
    app_defaults = app.state.served.default_chat_kwargs
    app_defaults["thinking"] = False  # what --default-chat-template-kwargs '{"thinking": false}' sets
    try:
        r = client.chat.completions.create(model="k3", messages=ASK, temperature=0, max_tokens=100)
        assert r.choices[0].message.content == "Plain."
        scripted.script(ASK, f"Hm.<|close|>think<|sep|><|open|>response<|sep|>Yes.<|close|>response<|sep|>{END}", thinking=True, reasoning_effort="high")
        r = client.chat.completions.create(  # a request's own kwarg wins over the default
            model="k3", messages=ASK, temperature=0, max_tokens=300, reasoning_effort="high", extra_body={"chat_template_kwargs": {"thinking": True}}
        )
        assert r.choices[0].message.content == "Yes." and getattr(r.choices[0].message, "reasoning_content", None) == "Hm."
    finally:
        app_defaults.clear()
