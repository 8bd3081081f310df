"""`POST /v1/responses` with the official `openai` client on the debug model: text and item input, instructions, the same
prompt and greedy text as chat, the typed stream events, previous_response_id through the bounded store (unknown, evicted
and store: false ids are 4xx naming the id), json_schema, and the fields refused by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from openk3.api.responses_store import ResponseStore
from tests.api.conftest import LiveServer

openai = pytest.importorskip("openai", reason="the openai client is the peer oracle for the wire format")

ASK = "Tell me a story"
RULES = "be brief"


@pytest.fixture(scope="module")
def client(live: LiveServer) -> Iterator[Any]:
    with openai.OpenAI(base_url=live.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def chat(client: Any, messages: list[dict[str, str]], max_tokens: int = 12, **kwargs: Any) -> Any:
    return client.chat.completions.create(model="debug", messages=messages, max_tokens=max_tokens, temperature=0, **kwargs)


def test_text_input_with_instructions_is_the_chat_request(client) -> None:
    r = client.responses.create(model="debug", input=ASK, instructions=RULES, max_output_tokens=12, temperature=0, metadata={"k": "v"})
    c = chat(client, [{"role": "system", "content": RULES}, {"role": "user", "content": ASK}])
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "debug"
    assert r.output_text == c.choices[0].message.content
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [p.type for p in item.content] == ["output_text"]
    assert r.usage.input_tokens == c.usage.prompt_tokens and r.usage.output_tokens == c.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.input_tokens + 12 and r.usage.output_tokens_details.reasoning_tokens == 0
    # 12 tokens cut the reply: incomplete, as OpenAI says it, and the item too
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens" and item.status == "incomplete"
    assert (r.instructions, r.max_output_tokens, r.temperature, r.metadata, r.store) == (RULES, 12, 0, {"k": "v"}, True)


def test_item_input_renders_as_the_same_messages(client) -> None:
    items = [
        {"role": "developer", "content": "answer in French"},
        {"role": "user", "content": [{"type": "input_text", "text": "Hello "}, {"type": "input_text", "text": "there"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Bonjour", "annotations": []}]},
        {"role": "user", "content": ASK},
    ]
    r = client.responses.create(model="debug", input=items, max_output_tokens=10, temperature=0)
    messages = [
        {"role": "developer", "content": "answer in French"},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": ASK},
    ]
    c = chat(client, messages, max_tokens=10)
    assert r.output_text == c.choices[0].message.content and r.usage.input_tokens == c.usage.prompt_tokens


def test_stream_events_build_the_same_response(client) -> None:
    kwargs: dict[str, Any] = dict(model="debug", input=ASK, instructions=RULES, max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert set(types[4 : 4 + len(deltas)]) == {"response.output_text.delta"} and deltas
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert types[4 + len(deltas) :] == tail
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:-2])
    assert "".join(deltas) == events[4 + len(deltas)].text == final.output_text == whole.output_text
    assert final.status == whole.status == "incomplete" and final.usage.output_tokens == whole.usage.output_tokens
    assert final.output[0].status == "incomplete"


def test_previous_response_id_continues_the_conversation(client) -> None:
    first = client.responses.create(model="debug", input="Hi", instructions=RULES, max_output_tokens=6, temperature=0)
    second = client.responses.create(model="debug", input="Next", previous_response_id=first.id, max_output_tokens=6, temperature=0)
    # the earlier turns come back; the earlier instructions do not (as OpenAI does)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "Next"}]
    c = chat(client, messages, max_tokens=6)
    assert second.previous_response_id == first.id and second.instructions is None
    assert second.output_text == c.choices[0].message.content and second.usage.input_tokens == c.usage.prompt_tokens
    with client.responses.stream(model="debug", input="Go on", previous_response_id=second.id, max_output_tokens=4, temperature=0) as stream:
        streamed = stream.get_final_response()
    third = client.responses.create(model="debug", input=[], previous_response_id=streamed.id, max_output_tokens=4, temperature=0)
    assert third.usage.input_tokens > streamed.usage.input_tokens > second.usage.input_tokens  # the stream's turn was kept


def _refusal(client: Any, **kwargs: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(model="debug", input=ASK, max_output_tokens=4)
    with pytest.raises(openai.APIStatusError) as caught:
        client.responses.create(**{**base, **kwargs})
    assert 400 <= caught.value.status_code < 500
    return {"status": caught.value.status_code, **caught.value.body}


def test_unknown_and_unstored_previous_response_ids_are_404s_naming_the_id(client) -> None:
    e = _refusal(client, previous_response_id="resp_nope")
    assert e["status"] == 404 and e["param"] == "previous_response_id" and e["code"] == "previous_response_not_found"
    assert "'resp_nope'" in e["message"] and "no such response" in e["message"]
    unstored = client.responses.create(model="debug", input=ASK, max_output_tokens=2, store=False)
    assert unstored.store is False
    e = _refusal(client, previous_response_id=unstored.id)
    assert e["status"] == 404 and unstored.id in e["message"]


def test_an_evicted_response_is_a_404_saying_so(client, live: LiveServer) -> None:
    app: Any = live.app
    kept = app.state.response_store
    app.state.response_store = ResponseStore(capacity=2)
    try:
        ids = [client.responses.create(model="debug", input=f"turn {i}", max_output_tokens=2).id for i in range(3)]
        e = _refusal(client, previous_response_id=ids[0])
        assert e["status"] == 404 and repr(ids[0]) in e["message"] and "evicted" in e["message"] and "2 most recently used" in e["message"]
        assert client.responses.create(model="debug", input="more", previous_response_id=ids[2], max_output_tokens=2).status
    finally:
        app.state.response_store = kept


def test_json_schema_goes_through_the_structured_output_path(client) -> None:
    properties = {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}
    schema: dict[str, Any] = {"type": "object", "properties": properties, "required": ["ok", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}
    r = client.responses.create(model="debug", input=ASK, max_output_tokens=40, temperature=0, text={"format": fmt})
    as_chat = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}}
    c = chat(client, [{"role": "user", "content": ASK}], max_tokens=40, response_format=as_chat)
    # the debug tokenizer has no end token, so the reply runs on past the object to max_output_tokens (as chat's does)
    value, _ = json.JSONDecoder().raw_decode(r.output_text)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9
    assert r.output_text == c.choices[0].message.content
    assert r.text.format.type == "json_schema" and r.text.format.name == "verdict"


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"top_logprobs": 2}, "top_logprobs", "not supported"),
        ({"truncation": "auto"}, "truncation", "only 'disabled'"),
        ({"background": True}, "background", "only False"),
        ({"include": ["reasoning.encrypted_content"]}, "include", "only []"),
        ({"reasoning": {"summary": "auto"}}, "reasoning", "summary"),
        ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
        ({"stream_options": {"include_obfuscation": False}}, "stream_options", "only allowed when stream is true"),
        ({"frobnicate": 1}, "frobnicate", "Extra inputs are not permitted"),
        ({"tools": [{"type": "web_search"}]}, "tools", "function"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input", "does not take images"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "'item_reference'"),
        ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice", "allowed_tools"),
        ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "1"}]}, "input", "'call_9' answers no function_call"),
        ({"reasoning": {"effort": "low"}}, "reasoning.effort", "reasoning.effort='low' is not supported"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format", "text.format.name is required"),
        ({"max_output_tokens": 10**6}, "max_output_tokens", "max_output_tokens"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(client, fields: dict[str, Any], param: str, says: str) -> None:
    fields = dict(fields)
    e = _refusal(client, extra_body=fields) if fields.keys() & {"frobnicate", "conversation"} else _refusal(client, **fields)
    assert e["status"] == 400 and e["param"] == param and says in e["message"], e


def test_retrieve_delete_and_input_items_over_the_store(client) -> None:
    items = [{"role": "developer", "content": "be terse"}, {"role": "user", "content": [{"type": "input_text", "text": ASK}]}]
    made = client.responses.create(model="debug", input=items, max_output_tokens=6, temperature=0, metadata={"k": "v"})
    got = client.responses.retrieve(made.id)
    assert got.model_dump() == made.model_dump()  # the Response as it was answered, usage and output items included
    listed = client.responses.input_items.list(made.id, order="asc")
    assert [(i.type, i.role) for i in listed.data] == [("message", "developer"), ("message", "user")]
    assert listed.data[1].content[0].text == ASK and all(i.id for i in listed.data) and listed.has_more is False
    newest = client.responses.input_items.list(made.id, limit=1)  # newest first by default, as OpenAI lists them
    assert [i.role for i in newest.data] == ["user"] and newest.has_more is True
    rest = client.responses.input_items.list(made.id, after=newest.data[0].id)
    assert [i.role for i in rest.data] == ["developer"]
    with client.responses.stream(model="debug", input="Hi", max_output_tokens=4, temperature=0) as stream:
        streamed = stream.get_final_response()
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
    (text_item,) = client.responses.input_items.list(streamed.id).data
    assert text_item.role == "user" and text_item.content[0].text == "Hi"
    assert client.responses.delete(made.id) is None  # the client's delete returns nothing on success
    for call in (lambda: client.responses.retrieve(made.id), lambda: client.responses.delete(made.id)):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        error = caught.value.body
        assert error["code"] == "response_not_found" and repr(made.id) in error["message"] and "deleted" in error["message"]
    e = _refusal(client, previous_response_id=made.id)
    assert e["status"] == 404 and e["code"] == "previous_response_not_found"


def test_unknown_unstored_and_evicted_ids_are_404s_on_retrieve(client, live: LiveServer) -> None:
    unstored = client.responses.create(model="debug", input=ASK, max_output_tokens=2, store=False)
    for response_id, says in (("resp_nope", "no such response"), (unstored.id, "store: false")):
        with pytest.raises(openai.NotFoundError) as caught:
            client.responses.retrieve(response_id)
        assert says in caught.value.body["message"] and caught.value.body["type"] == "not_found_error"
    app: Any = live.app
    kept = app.state.response_store
    app.state.response_store = ResponseStore(capacity=1)
    try:
        first, _ = (client.responses.create(model="debug", input=f"turn {i}", max_output_tokens=2).id for i in range(2))
        with pytest.raises(openai.NotFoundError) as caught:
            client.responses.retrieve(first)
        assert "evicted" in caught.value.body["message"]
    finally:
        app.state.response_store = kept


def test_bad_input_items_queries_are_400s(client, live: LiveServer) -> None:
    made = client.responses.create(model="debug", input=ASK, max_output_tokens=2)
    for query, param in (({"limit": 0}, "limit"), ({"after": "msg_x"}, "after"), ({"order": "up"}, "order"), ({"include": ["x"]}, "include")):
        r = httpx.get(f"{live.base_url}/v1/responses/{made.id}/input_items", params=query)
        assert r.status_code == 400 and param in r.json()["error"]["message"], (query, r.text)
