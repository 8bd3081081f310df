"""`POST /v1/responses` with tools and reasoning, through the official `openai` client and (when installed) the OpenAI
Agents SDK's default model: a scripted model writes exact K3 replies after the demo model's K3-style template
(tests/api/test_tool_calls_server.py), so each turn's prompt must be exactly the chat messages the items mean."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.api.conftest import stop_server
from tests.api.test_tool_calls_server import CALL, END, WEATHER, Scripted

openai = pytest.importorskip("openai", reason="the openai client is the peer oracle for the wire format")

ASK = "Weather in Paris?"
TOOL = {"type": "function", **WEATHER["function"]}  # the Responses API's flat tool
CALLING = f"I should look.<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|><|open|>tools<|sep|>{CALL}<|close|>tools<|sep|>{END}"
THINKING = f"I should look.<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|>{END}"
ANSWER = f"It is mild.<|close|>think<|sep|><|open|>response<|sep|>18C in Paris.<|close|>response<|sep|>{END}"


@pytest.fixture(scope="module")
def scripted(torch_one_thread) -> Iterator[Scripted]:
    s = Scripted()
    yield s
    stop_server(s.live)


@pytest.fixture(scope="module")
def client(scripted: Scripted) -> Iterator[Any]:
    with openai.OpenAI(base_url=scripted.live.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def after_call(call_id: str, tool: dict[str, Any] = WEATHER, system: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The chat messages of the second turn: the call's turn as one assistant message, then the tool's answer."""
    call = {"id": call_id, "type": "function", "function": {"name": tool["function"]["name"], "arguments": '{"city": "Paris"}'}}
    turn = {"role": "assistant", "content": "Checking.", "reasoning_content": "I should look.", "tool_calls": [call]}
    return [*(system or []), {"role": "user", "content": ASK}, turn, {"role": "tool", "tool_call_id": call_id, "content": "18C"}]


def summary(r: Any) -> list[tuple[Any, ...]]:
    """A response's items without their ids."""
    out: list[tuple[Any, ...]] = []
    for item in r.output:
        if item.type == "reasoning":
            out.append(("reasoning", [c.text for c in item.content], item.summary))
        elif item.type == "message":
            out.append(("message", [c.text for c in item.content]))
        else:
            out.append(("function_call", item.name, item.arguments, item.call_id))
    return out


def test_a_tool_call_round_trip_with_previous_response_id(scripted: Scripted, client: Any) -> None:
    scripted.script([{"role": "user", "content": ASK}], CALLING, tools=[WEATHER])
    first = client.responses.create(model="k3", input=ASK, tools=[TOOL], temperature=0, max_output_tokens=400)
    reasoning, message, call = first.output
    assert (reasoning.type, [c.text for c in reasoning.content], reasoning.summary) == ("reasoning", ["I should look."], [])
    assert (message.type, first.output_text) == ("message", "Checking.")
    assert (call.type, call.name, json.loads(call.arguments), call.status) == ("function_call", "get_weather", {"city": "Paris"}, "completed")
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and first.status == "completed"
    assert first.usage.output_tokens_details.reasoning_tokens == len("I should look.")  # the byte tokenizer: one token a byte

    scripted.script(after_call(call.call_id), ANSWER, tools=[WEATHER])
    answer = [{"type": "function_call_output", "call_id": call.call_id, "output": "18C"}]
    second = client.responses.create(model="k3", input=answer, previous_response_id=first.id, tools=[TOOL], temperature=0, max_output_tokens=400)
    assert summary(second) == [("reasoning", ["It is mild."], []), ("message", ["18C in Paris."])]

    # the same conversation sent whole (what a client does with store: false) is the same prompt, so the same answer
    items = [{"role": "user", "content": ASK}, *[o.model_dump(exclude_none=True) for o in first.output], *answer]
    stateless = client.responses.create(model="k3", input=items, tools=[TOOL], temperature=0, max_output_tokens=400, store=False)
    assert summary(stateless) == summary(second)


def test_a_streamed_call_is_the_whole_response(scripted: Scripted, client: Any) -> None:
    scripted.script([{"role": "user", "content": ASK}], CALLING, tools=[WEATHER])
    kwargs: dict[str, Any] = dict(model="k3", input=ASK, tools=[TOOL], temperature=0, max_output_tokens=400)
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [s[:3] for s in summary(final)] == [s[:3] for s in summary(whole)]  # call ids are new per response
    types = [e.type for e in events]
    collapsed = [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]  # runs of deltas as one
    item = ["response.output_item.added", "response.content_part.added"]
    done = ["response.content_part.done", "response.output_item.done"]
    assert collapsed == [
        "response.created",
        "response.in_progress",
        *item,
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        *done,
        *item,
        "response.output_text.delta",
        "response.output_text.done",
        *done,
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(fragments) > 5 and "".join(fragments) == '{"city": "Paris"}'  # streamed as written
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1, 2]


def test_a_named_tool_choice_forces_the_call(scripted: Scripted, client: Any) -> None:
    """tool_choice {"type": "function", "name"} is chat's named choice: the prompt opens the call (K3), the grammar writes it."""
    prefix = '<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
    rest = '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>' + END
    scripted.script([{"role": "user", "content": ASK}], rest, tools=[WEATHER], forced=prefix)
    named = {"type": "function", "name": "get_weather"}
    r = client.responses.create(model="k3", input=ASK, tools=[TOOL], tool_choice=named, temperature=0, max_output_tokens=400)
    assert [s[:3] for s in summary(r)] == [("function_call", "get_weather", '{"city": "Paris"}')]
    assert r.tool_choice.name == "get_weather"


@pytest.mark.parametrize(("effort", "reply", "reasoning"), [("none", f"Plain.<|close|>response<|sep|>{END}", []), ("high", THINKING, ["I should look."])])
def test_reasoning_effort_is_the_templates_thinking_switch(scripted: Scripted, client: Any, effort: str, reply: str, reasoning: list[str]) -> None:
    scripted.script([{"role": "user", "content": ASK}], reply, effort=effort)
    r = client.responses.create(model="k3", input=ASK, reasoning={"effort": effort}, temperature=0, max_output_tokens=400)
    assert [c.text for item in r.output if item.type == "reasoning" for c in item.content] == reasoning
    assert r.output_text == ("Plain." if effort == "none" else "Checking.") and r.reasoning.effort == effort


def test_the_agents_sdk_default_model_runs_a_tool_loop(scripted: Scripted) -> None:
    pytest.importorskip("agents", reason="the OpenAI Agents SDK (openai-agents) drives its default Responses model")
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool
    from agents.tool_context import ToolContext

    seen: list[str] = []

    def get_weather(ctx: ToolContext, city: str) -> str:
        """Weather of a city"""
        seen.append(city)
        # the tool runs between the SDK's two requests: script the reply to the second, whose prompt names this call
        system = [{"role": "system", "content": "Use tools."}]
        scripted.script(after_call(ctx.tool_call_id, tool, system), ANSWER, tools=[tool])
        return "18C"

    # the SDK finds the context parameter by its type; this module's annotations are strings it cannot resolve locally
    get_weather.__annotations__ = {"ctx": ToolContext, "city": str, "return": str}
    sdk_tool = function_tool(get_weather)
    params = sdk_tool.params_json_schema
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": params, "strict": True}}
    scripted.script([{"role": "system", "content": "Use tools."}, {"role": "user", "content": ASK}], CALLING, tools=[tool])
    model = OpenAIResponsesModel(model="k3", openai_client=openai.AsyncOpenAI(base_url=scripted.live.base_url + "/v1", api_key="unused", max_retries=0))
    settings = ModelSettings(temperature=0)  # the scripted model's one-hot logits still leave sampling a 1% chance per token
    agent = Agent(name="weather", instructions="Use tools.", tools=[sdk_tool], model=model, model_settings=settings)
    result = Runner.run_sync(agent, ASK, run_config=RunConfig(tracing_disabled=True))
    assert seen == ["Paris"] and result.final_output == "18C in Paris."
