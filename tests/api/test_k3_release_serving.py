"""A folder laid out like the released Kimi K3 (kimi_k3 config.json, sharded safetensors with MXFP4 experts, the vision
tower, MTP tensors to skip, K3's tiktoken tokenizer with its own special tokens and their release ids, generation_config.json,
and the release's Python files, which must never run) served by `openk3 serve --model <folder>` and driven by the official
`openai` client: K3's encoding, thinking on and off, reasoning_effort, auto / required / named tool calls whole and streamed,
tool history, JSON mode. The weights are random, so the tests check what the server controls: the prompt, the grammar, the
parsing, the stops and the token counts."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from openk3.api.chat_k3 import K3Template
from openk3.api.protocol import ChatMessage
from openk3.cli import build_parser
from openk3.config import debug
from openk3.launch.server import build_server
from openk3.serve.kimi_tokenizer import KimiTokenizer
from tests.api.conftest import LiveServer, serve_app, stop_server
from tests.model.conftest import build
from tests.model.test_release_layout import release_tensors, write_release
from tests.serve.test_kimi_tokenizer import K3_SPECIALS, write_kimi_tokenizer

openai = pytest.importorskip("openai", reason="the openai client is the peer oracle for the wire format")

NEVER_RUN = "raise SystemExit('openk3 must never run the release Python files')\n"
XTML_WORDS = ("message role system user assistant tool argument key type string call tools response think index name",) * 20
CITY = {"type": "string", "enum": ["Paris", "Rome"]}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": CITY}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "integer"}}, "required": ["zone"]}}},
]
ASK = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


# the release's media_proc_cfg keys, at this small tower's patch size (3 pixels) and with a small patch budget
MEDIA_PROC_CFG = {
    "patch_size": 3,
    "merge_kernel_size": 2,
    "in_patch_limit": 64,
    "patch_limit_on_one_side": 16,
    "fixed_output_tokens": None,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "in_patch_limit_each_frame": 64,
    "temporal_merge_kernel_size": 4,
    "timestamp_mode": "hh:mm:ss.fff",
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("k3_release")
    vocab = write_kimi_tokenizer(root / "tok", merges=400, specials=K3_SPECIALS, corpus=XTML_WORDS)
    model = build(debug().replace(vocab_size=vocab))
    model.quantize_experts()
    path = write_release(root / "Kimi-K3", model, release_tensors(model), specials=K3_SPECIALS)
    for name in ("tiktoken.model", "tokenizer_config.json"):  # the tokenizer trained with XTML's words, as K3's knows them
        shutil.copy(root / "tok" / name, path / name)
    end_of_msg = vocab - 256 + 2
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": end_of_msg, "temperature": 1.0}))
    for name in ("encoding_k3.py", "tokenization_kimi.py", "kimi_k3_processor.py"):
        (path / name).write_text(NEVER_RUN)
    (path / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": MEDIA_PROC_CFG}))
    return path


@pytest.fixture(scope="module")
def live(folder: Path, torch_one_thread) -> Iterator[LiveServer]:
    args = build_parser().parse_args(["serve", "--model", str(folder), "--max-model-len", "2048", "--cache-memory-mb", "32"])
    server = serve_app(build_server(args))
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(live: LiveServer) -> Iterator[Any]:
    with openai.OpenAI(base_url=live.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tok(folder: Path) -> KimiTokenizer:
    return KimiTokenizer(folder)


def model_id(client) -> str:
    return client.models.list().data[0].id


def prompt_of(http: httpx.Client, client, **fields: Any) -> tuple[list[int], str]:
    ids = http.post("/tokenize", json={"model": model_id(client), **fields}).json()["tokens"]
    return ids, http.post("/detokenize", json={"model": model_id(client), "tokens": ids}).json()["prompt"]


def k3_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None, **extra: Any) -> str:
    checked = [ChatMessage.model_validate(m) for m in messages]
    return K3Template("test").render_prompt(checked, tools=tools, extra=extra).text


def test_the_folder_is_served_with_k3s_encoding_and_its_tokens(http, client, tok, caplog) -> None:
    ids, text = prompt_of(http, client, messages=ASK, tools=TOOLS)
    assert text == k3_prompt(ASK, TOOLS)
    assert "<|im_" not in text and text.endswith('<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    specials = {tok.decode([i], skip_special_tokens=False) for i in ids if i >= tok.num_base}
    assert specials == {"<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>"}  # every marker is its one token
    assert ids.count(tok.num_base + 3) == text.count("<|open|>")


def test_thinking_effort_and_thinking_off(http, client) -> None:
    _, low = prompt_of(http, client, messages=ASK, reasoning_effort="low")
    assert "`thinking_effort=low`" in low and low == k3_prompt(ASK, reasoning_effort="low")
    off_ids, off = prompt_of(http, client, messages=ASK, chat_template_kwargs={"thinking": False})
    none_ids, _ = prompt_of(http, client, messages=ASK, reasoning_effort="none")
    assert off_ids == none_ids and "thinking-effort" not in off and off.endswith("<|open|>response<|sep|>")
    thinking = client.chat.completions.create(model=model_id(client), messages=ASK, max_tokens=6, temperature=0)
    assert thinking.choices[0].message.reasoning_content and not thinking.choices[0].message.content
    plain = client.chat.completions.create(model=model_id(client), messages=ASK, max_tokens=6, temperature=0, reasoning_effort="none")
    assert plain.choices[0].message.content and getattr(plain.choices[0].message, "reasoning_content", None) is None
    assert plain.usage.prompt_tokens == len(none_ids)
    with pytest.raises(openai.BadRequestError, match="medium"):
        client.chat.completions.create(model=model_id(client), messages=ASK, max_tokens=2, reasoning_effort="medium")


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_is_written_with_k3s_tokens_and_stops_on_the_checkpoints_eos(client, tok, choice: str) -> None:
    tool_choice = NAMED if choice == "named" else "required"
    tools = TOOLS[:1] if choice == "required" else TOOLS  # required over one tool is that tool
    r = client.chat.completions.create(
        model=model_id(client), messages=ASK, tools=tools, tool_choice=tool_choice, max_tokens=200, temperature=0, reasoning_effort="none", logprobs=True
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in CITY["enum"]
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    written = [t.token for t in r.choices[0].logprobs.content]
    value = written[written.index("<|sep|>") + 1 : written.index("<|close|>")]
    assert "".join(value) in CITY["enum"]
    # each marker one token, the format's text as K3's tokenizer writes it, the value the model's, then the release's eos
    text = lambda s: [tok.decode([i]) for i in tok.encode_ordinary(s)]  # noqa: E731
    want = ["<|open|>", *text('argument key="city" type="string"'), "<|sep|>", *value, "<|close|>", *text("argument"), "<|sep|>"]
    for block in ("call", "tools", "message"):
        want += ["<|close|>", *text(block), "<|sep|>"]
    assert written == [*want, "<|end_of_msg|>"]
    assert r.usage.completion_tokens == len(want) + 1


def test_a_streamed_forced_call_sends_a_chunk_per_argument_piece(client) -> None:
    stream = client.chat.completions.create(model=model_id(client), messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=200, temperature=0, stream=True)
    chunks = list(stream)
    calls = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert calls[0].function.name == "get_weather" and calls[0].id
    assert json.loads("".join(c.function.arguments or "" for c in calls))["city"] in CITY["enum"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert len(chunks) == 1 + len(calls) + 1  # the role, the call's pieces, the finish: markup sends no empty chunks
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_auto_tools_and_tool_history_in_call_order(http, client) -> None:
    history: list[dict[str, Any]] = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": 2}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "b", "content": "14:00"},  # out of call order
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
    ]
    _, text = prompt_of(http, client, messages=history, tools=TOOLS)
    assert text == k3_prompt(history, TOOLS)
    assert text.index('role="tool" tool="get_weather" index="1"<|sep|>sunny') < text.index('role="tool" tool="get_time" index="2"<|sep|>14:00')
    assert '<|open|>argument key="zone" type="number"<|sep|>2<|close|>argument' in text
    for stream in (False, True):
        r = client.chat.completions.create(model=model_id(client), messages=history, tools=TOOLS, max_tokens=24, temperature=0, stream=stream)
        if stream:
            content = "".join(c.choices[0].delta.content or "" for c in r if c.choices)
        else:
            assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
            content = r.choices[0].message.content or ""
        assert "<|" not in content  # markup never reaches a client as text


def test_json_mode_with_thinking_on_and_off(client) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    for effort in ("none", "low"):
        r = client.chat.completions.create(model=model_id(client), messages=ASK, max_tokens=40, temperature=0, reasoning_effort=effort, response_format=fmt)
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content)["ok"], bool)


def test_the_release_files_are_named_at_start_up_and_never_run(folder: Path, caplog) -> None:
    with caplog.at_level(logging.INFO):
        build_server(build_parser().parse_args(["serve", "--model", str(folder), "--max-model-len", "256", "--cache-memory-mb", "8"]))
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "encoding_k3.py: not run: openk3's own api/k3_encoding.py implements it" in text
    assert "tokenization_kimi.py: not run" in text and "chat prompts: Kimi K3's encoding" in text
    assert "generation_config.json: stop tokens" in text


def test_langchain_binds_a_tool_and_asks_for_structured_output(live: LiveServer, client) -> None:
    chat_openai = pytest.importorskip("langchain_openai", reason="LangChain's ChatOpenAI is a real client of the chat API")
    from pydantic import BaseModel

    class Answer(BaseModel):
        ok: bool

    llm = chat_openai.ChatOpenAI(model=model_id(client), base_url=live.base_url + "/v1", api_key="unused", temperature=0, max_tokens=200)
    llm = llm.bind(reasoning_effort="none")
    called = llm.bind_tools(TOOLS[:1], tool_choice="get_weather").invoke("weather in Paris?")
    (call,) = called.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in CITY["enum"]
    answer = llm.with_structured_output(Answer, method="json_schema").invoke("is it sunny?")
    assert isinstance(answer, Answer)


def test_an_image_through_the_release_folder(client, tok) -> None:
    """The folder's vision tower, preprocessor_config.json and media tokens take an image: 30 x 20 pixels in 3-pixel
    patches is 10 x 7, padded to 10 x 8, merged 2 x 2 into 20 tokens, plus the marker (begin, "image 30x20", content, end)."""
    pytest.importorskip("PIL.Image", reason="Pillow (the vision extra) decodes images")
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (30, 20), (10, 200, 30)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    text = {"type": "text", "text": "What colour?"}
    ask = dict(model=model_id(client), max_tokens=2, temperature=0, extra_body={"chat_template_kwargs": {"thinking": False}})
    plain = client.chat.completions.create(messages=[{"role": "user", "content": [text]}], **ask).usage.prompt_tokens
    got = client.chat.completions.create(messages=[{"role": "user", "content": [text, {"type": "image_url", "image_url": {"url": url}}]}], **ask)
    assert got.usage.prompt_tokens == plain + 3 + len(tok.encode("image 30x20")) + 20
