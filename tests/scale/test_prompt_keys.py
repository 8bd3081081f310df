"""The router's prompt ids for a chat are the replica's own: the same tokens its /tokenize gives for the request, tools,
reasoning effort and template kwargs included (K3's encoding renders each into the prompt); and a chat whose reply the
server opens inside the prompt (a forced call, structured output) is never handed to a prefill replica as it stands."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from openk3.api.chat_loading import load_chat_template
from openk3.cli import build_parser
from openk3.launch.server import build_server
from openk3.scale.prompt_keys import PromptKeys
from openk3.serve.loading import ASSETS, model_tokenizer
from tests.api.conftest import LiveServer, serve_app, stop_server

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "weather in Paris?"}]
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    server = serve_app(build_server(build_parser().parse_args(["serve", "--model", "tiny", "--max-num-seqs", "4", "--cache-memory-mb", "16"])))
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def keys() -> PromptKeys:
    return PromptKeys(model_tokenizer("tiny", 0), load_chat_template(ASSETS / "tiny"), "tiny", match_unit=16)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"tools": TOOLS},
        {"reasoning_effort": "none"},
        {"reasoning_effort": "low", "tools": TOOLS},
        {"chat_template_kwargs": {"thinking": False}},
    ],
)
def test_a_chats_routing_ids_are_the_replicas_prompt(live: LiveServer, keys: PromptKeys, fields: dict) -> None:
    body = {"model": "tiny", "messages": ASK, **fields}
    with httpx.Client(base_url=live.base_url, timeout=60) as http:
        want = http.post("/tokenize", json=body).json()["tokens"]
    assert keys.prompt_ids(CHAT, json.dumps(body).encode()) == want


def test_only_a_prompt_the_server_keeps_as_it_is_is_handed_off(keys: PromptKeys) -> None:
    def handoff(**fields) -> bool:
        body = json.dumps({"model": "tiny", "messages": ASK, **fields}).encode()
        ids = keys.prompt_ids(CHAT, body)
        return keys.handoff_ids(CHAT, body, ids) == ids and ids is not None

    assert handoff() and handoff(tools=TOOLS) and handoff(tools=TOOLS, tool_choice="auto")
    assert not handoff(tools=TOOLS, tool_choice="required")
    assert not handoff(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert not handoff(response_format={"type": "json_object"})
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": [image, {"type": "text", "text": "what is it?"}]}]}).encode()
    assert keys.handoff_ids(CHAT, body, [1, 2, 3]) is None


def test_the_replicas_default_template_kwargs_are_rendered_under_the_requests(keys: PromptKeys) -> None:
    off = PromptKeys(keys.tokenizer, keys.template, "tiny", 16, {"thinking": False})
    body = lambda **f: json.dumps({"model": "tiny", "messages": ASK, **f}).encode()  # noqa: E731
    assert off.prompt_ids(CHAT, body()) == keys.prompt_ids(CHAT, body(chat_template_kwargs={"thinking": False}))
    assert off.prompt_ids(CHAT, body(chat_template_kwargs={"thinking": True})) == keys.prompt_ids(CHAT, body())
