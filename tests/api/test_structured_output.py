"""Structured output through the server with the official `openai` client, on the demo model `tiny`: JSON for a schema it
has never seen (validated with `jsonschema` when installed), json_object, vLLM's extras, and the 400s that name the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from openk3.api.chat_loading import load_chat_template
from openk3.api.served_model import ModelIdentity
from openk3.api.server import ServerConfig, create_app
from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.loading import ASSETS, build_model
from tests.api.conftest import LiveServer, serve_app, stop_server

openai = pytest.importorskip("openai", reason="the openai client is the peer oracle for the wire format")

# a schema of nothing the demo model was trained on; bounded values so that greedy decoding ends well within max_tokens
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "planet": {"type": "string", "maxLength": 10},
        "moons": {"type": "integer", "minimum": 0, "maximum": 300},
        "ringed": {"type": "boolean"},
        "class": {"enum": ["rocky", "gas giant", "ice giant"]},
        "probes": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["planet", "moons", "ringed", "class", "probes"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a planet."}]


def check(instance: Any, schema: dict[str, Any]) -> None:
    """jsonschema when installed, else the checks SCHEMA needs."""
    try:
        import jsonschema
    except ImportError:
        assert isinstance(instance, dict) and set(instance) == set(schema["required"])
        props = schema["properties"]
        assert isinstance(instance["planet"], str) and len(instance["planet"]) <= props["planet"]["maxLength"]
        assert isinstance(instance["moons"], int) and 0 <= instance["moons"] <= 300
        assert isinstance(instance["ringed"], bool) and instance["class"] in props["class"]["enum"]
        assert isinstance(instance["probes"], list) and len(instance["probes"]) <= 2 and all(isinstance(p, str) and len(p) <= 6 for p in instance["probes"])
        return
    jsonschema.validate(instance, schema)


@pytest.fixture(scope="module")
def live(torch_one_thread) -> Iterator[LiveServer]:
    model, tokenizer = build_model("tiny", torch.float32, "cpu", seed=0)
    engine = LLMEngine(model, tokenizer, EngineConfig(num_pages=256, page_size=16, max_num_seqs=8, max_model_len=2048))
    app = create_app(engine, tokenizer, load_chat_template(ASSETS / "tiny"), ServerConfig(ModelIdentity("tiny", "tiny")))
    live = serve_app(app, startup_s=60)
    yield live
    stop_server(live)


@pytest.fixture(scope="module")
def client(live: LiveServer) -> Iterator[Any]:
    with openai.OpenAI(base_url=live.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "planet", "schema": schema, "strict": True}}


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_json_schema_is_valid(client, thinking: bool) -> None:
    r = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=300,
        temperature=0,
        response_format=json_schema_format(SCHEMA),
        extra_body={"chat_template_kwargs": {"thinking": thinking}},
    )
    (choice,) = r.choices
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    check(json.loads(choice.message.content), SCHEMA)


def test_sampled_and_streamed_json_is_valid(client) -> None:
    chunks = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=300, temperature=1.0, seed=7, n=2, stream=True, response_format=json_schema_format(SCHEMA)
    )
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            finish[ch.index] = ch.finish_reason or finish.get(ch.index)
    assert sorted(texts) == [0, 1] and set(finish.values()) == {"stop"}
    for text in texts.values():
        check(json.loads(text), SCHEMA)


def test_json_object_and_completions(client) -> None:
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    c = client.completions.create(model="tiny", prompt="A planet:", max_tokens=300, temperature=0, extra_body={"guided_json": SCHEMA})
    check(json.loads(c.choices[0].text), SCHEMA)


def test_vllm_extras(client) -> None:
    r = client.completions.create(model="tiny", prompt="Yes or no?", max_tokens=20, temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(
        model="tiny", prompt="A code:", max_tokens=20, temperature=0, extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}}
    )
    text = r.choices[0].text
    assert len(text) == 6 and text[:2].isupper() and text[2] == "-" and text[3:].isdigit()
    grammar = 'root ::= "(" [a-z] [a-z]? [a-z]? " " [0-9] ")"'
    r = client.completions.create(model="tiny", prompt="A pair:", max_tokens=30, temperature=0, extra_body={"guided_grammar": grammar})
    text = r.choices[0].text
    assert text.startswith("(") and text.endswith(")") and text[-2].isdigit()


def test_max_tokens_cuts_the_json(client) -> None:
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, temperature=0, response_format=json_schema_format(SCHEMA))
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"guided_regex": "("}, "guided_regex"),
        ({"guided_grammar": "root ::= "}, "guided_grammar"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
        ({"guided_json": SCHEMA, "min_tokens": 3}, "min_tokens"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
        ({"guided_json": SCHEMA, "tools": [{"type": "function", "function": {"name": "f"}}]}, "guided_json"),
    ],
)
def test_refusals_name_the_field(client, body: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, extra_body=body)
    assert e.value.body["param"] == param, e.value.body  # type: ignore[index]


WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "alerts": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS, "strict": True}},
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}},
    },
]
ASK = [{"role": "user", "content": "Weather in Paris, or the time?"}]


def schema_of(name: str) -> dict[str, Any]:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_enforced_calls_match_their_schema(client, choice: Any, stream: bool) -> None:
    kwargs: dict[str, Any] = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=300)
    if stream:
        calls: dict[int, dict[str, str]] = {}
        finish = None
        for c in client.chat.completions.create(**kwargs, stream=True):
            for ch in c.choices:
                finish = ch.finish_reason or finish
                for d in ch.delta.tool_calls or ():
                    call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
        got = [(c["name"], c["arguments"]) for c in calls.values()]
    else:
        r = client.chat.completions.create(**kwargs)
        finish = r.choices[0].finish_reason
        got = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls or ()]
    assert finish == "tool_calls" and len(got) == 1
    name, arguments = got[0]
    assert name in ("get_weather", "get_time") if choice == "required" else name == "get_weather"
    check_args(json.loads(arguments), schema_of(name))


def check_args(args: Any, schema: dict[str, Any]) -> None:
    try:
        import jsonschema
    except ImportError:
        assert isinstance(args, dict) and set(schema["required"]) <= set(args) <= set(schema["properties"])
        for key, value in args.items():
            prop = schema["properties"][key]
            assert value in prop["enum"] if "enum" in prop else isinstance(value, {"string": str, "integer": int, "boolean": bool}[prop["type"]])
        return
    jsonschema.validate(args, schema)


@pytest.mark.parametrize("stream", [False, True])
def test_strict_tools_with_auto_are_text_or_valid_calls(client, stream: bool) -> None:
    kwargs: dict[str, Any] = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=200)
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        assert chunks and all(c.choices[0].finish_reason in (None, "stop", "tool_calls", "length") for c in chunks if c.choices)
        return
    r = client.chat.completions.create(**kwargs)
    for call in r.choices[0].message.tool_calls or ():  # the demo model may answer in text; any call it makes is valid
        if call.function.name == "get_weather" and r.choices[0].finish_reason != "length":
            check_args(json.loads(call.function.arguments), schema_of("get_weather"))
    loose = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": ["string", "null"]}}}, "strict": True}}
    ]
    for choice in ("required", "auto"):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=ASK, tools=loose, tool_choice=choice, max_tokens=5)
        assert e.value.body["param"] == "tools"  # type: ignore[index]


@pytest.mark.parametrize("fmt", ["kimi_k2", "kimi_k3"])
def test_auto_grammar_allows_text_or_a_section_of_valid_calls(fmt: str) -> None:
    import xgrammar as xgr

    from openk3.api.chat_format import ChatFormat
    from openk3.api.protocol import ChatCompletionRequest
    from openk3.api.tool_choice import plan_tools
    from openk3.serve.structured.compiler import GrammarCompiler
    from openk3.serve.tokenizer import ByteTokenizer

    req = ChatCompletionRequest.model_validate({"messages": ASK, "tools": TOOLS, "tool_choice": "auto"})
    spec = plan_tools(req, ChatFormat(fmt), True).call_grammar(0)
    assert spec is not None
    grammar = GrammarCompiler(ByteTokenizer(260), 260).compile(spec)

    def accepts(text: str) -> bool:
        return xgr.GrammarMatcher(grammar.compiled).accept_string(text)

    if fmt == "kimi_k2":
        open_, close, call = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", K2_CALL.removesuffix("<|tool_calls_section_end|>")
        loose = '<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{"any": [1]}<|tool_call_end|>'
    else:
        open_, close, call = "<|open|>tools<|sep|>", "<|close|>tools<|sep|>", K3_CALL.removesuffix("<|close|>tools<|sep|><|close|>message<|sep|>")
        loose = '<|open|>call tool="get_time" index="2"<|sep|><|open|>argument key="zone" type="string"<|sep|>utc<|close|>argument<|sep|><|close|>call<|sep|>'
    assert accepts("Just text, no call.")
    assert accepts(f"Let me look.{open_}{call}{loose}{close}and after")
    assert not accepts(f"x{open_}{call.replace('3', '9')}")  # a strict tool's arguments follow its schema
    assert not accepts(f"x{open_}{close}")  # a section holds at least one call
    assert not accepts("x" + call)  # no call outside a section


K2_CALL = '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|><|tool_calls_section_end|>'
K3_CALL = (
    '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
    '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>'
)


@pytest.mark.parametrize(("fmt", "good"), [("kimi_k2", K2_CALL), ("kimi_k3", K3_CALL)])
def test_call_grammar_accepts_a_valid_call_and_refuses_bad_arguments(fmt: str, good: str) -> None:
    """The shape of the enforced-call grammar in both formats, without a model: "required" over both tools."""
    import xgrammar as xgr

    from openk3.api.chat_format import ChatFormat
    from openk3.api.protocol import ChatCompletionRequest
    from openk3.api.tool_choice import plan_tools
    from openk3.serve.structured.compiler import GrammarCompiler
    from openk3.serve.tokenizer import ByteTokenizer

    req = ChatCompletionRequest.model_validate({"messages": ASK, "tools": TOOLS, "tool_choice": "required"})
    spec = plan_tools(req, ChatFormat(fmt), True).call_grammar(0)
    assert spec is not None
    grammar = GrammarCompiler(ByteTokenizer(260), 260).compile(spec)

    def accepts(text: str) -> bool:
        m = xgr.GrammarMatcher(grammar.compiled)
        return m.accept_string(text) and m.is_completed()

    assert accepts(good)
    assert not accepts(good.replace("3", "9"))  # days above its maximum
    assert not accepts(good.replace("Paris", "Pa<ris") if fmt == "kimi_k3" else good.replace('"days": 3', '"days": "3"'))
    assert not accepts(good.replace("get_weather", "get_wether"))
