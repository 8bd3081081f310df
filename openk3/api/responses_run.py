"""`POST /v1/responses` on the chat path: the request as a chat job (api/responses_input.py, api/jobs.py chat_job), run
to a whole Response or streamed as typed events (api/responses_output.py), and the conversation kept for
previous_response_id unless `store` is false (api/responses_store.py).

Stream events are SSE with the event's type as the `event:` line, as OpenAI sends them, and no `[DONE]`; the stream ends
with `response.completed` whatever the status (see there), or, for an error after it has started, an `error` event
(OpenAI's `{type, code, message, param}`).
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from openk3.api.agent_output import ChoiceParser
from openk3.api.errors import APIError, frontend_error
from openk3.api.jobs import ChatJob, chat_job
from openk3.api.protocol import ChatMessage, FunctionCall, ToolCall
from openk3.api.responses_input import chat_request, conversation, rename_error
from openk3.api.responses_output import (
    Event,
    FunctionCallOutput,
    InputTokensDetails,
    MessageOutput,
    OutputItems,
    OutputTokensDetails,
    ReasoningOutput,
    ResponseObject,
    ResponseUsage,
    Status,
    new_id,
)
from openk3.api.responses_request import ResponsesRequest
from openk3.api.responses_store import ResponseStore, StoredResponse
from openk3.api.served_model import ServedModel
from openk3.api.updates import Updates, final_outputs, open_updates
from openk3.serve.output import OutputKind

log = logging.getLogger("openk3.api")


@dataclass(frozen=True)
class ResponseJob:
    """A Responses request ready to run: its chat job, and the conversation it continues (for the store)."""

    req: ResponsesRequest
    chat: ChatJob
    messages: tuple[ChatMessage, ...]  # the input's conversation, without the instructions
    response_id: str


async def response_job(s: ServedModel, req: ResponsesRequest, store: ResponseStore) -> ResponseJob:
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options", code="invalid_value")
    before = store.conversation(req.previous_response_id) if req.previous_response_id is not None else ()
    messages = conversation(req, before)
    try:
        chat = await chat_job(s, chat_request(req, messages))
    except APIError as e:
        raise rename_error(e) from e
    return ResponseJob(req, chat, tuple(messages), new_id("resp"))


def _feed(items: OutputItems, parser: ChoiceParser | None, text: str, finished: bool, stop_reason: int | str | None) -> list[Event]:
    """One step's text (or the whole reply's) into the items; without a Kimi chat format it is all message text."""
    if parser is None:
        return items.feed(content=text)
    piece = parser.feed(text, final=finished, stop_reason=stop_reason)
    return items.feed(piece.reasoning, piece.content, piece.tool_calls)


def _response(
    job: ResponseJob, s: ServedModel, items: OutputItems | None = None, status: str = "in_progress", usage: ResponseUsage | None = None
) -> ResponseObject:
    """The Response object with what the request asked for echoed back, as OpenAI does."""
    req = job.req
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, BaseModel) else req.tool_choice or "auto"
    return ResponseObject.model_validate(
        {
            "id": job.response_id,
            "model": s.model.name,
            "status": status,
            "output": list(items.items) if items is not None else [],
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store,
            "temperature": req.temperature,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}},
            "tool_choice": choice,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
            "top_p": req.top_p,
            "usage": usage,
            "user": req.user,
        }
    )


async def _usage(s: ServedModel, job: ResponseJob, items: OutputItems, output_tokens: int, cached: int) -> ResponseUsage:
    """OpenAI's usage; reasoning_tokens by encoding the reasoning text again (the engine counts tokens, not which block
    they fell in)."""
    reasoning = "".join(part.text for item in items.items if isinstance(item, ReasoningOutput) for part in item.content)
    reasoning_tokens = len(await s.encoder.run(lambda: s.tokenizer.encode(reasoning, add_special_tokens=False))) if reasoning else 0
    input_tokens = len(job.chat.job.prompt_token_ids)
    return ResponseUsage(
        input_tokens=input_tokens,
        input_tokens_details=InputTokensDetails(cached_tokens=cached),
        output_tokens=output_tokens,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=min(reasoning_tokens, output_tokens)),
        total_tokens=input_tokens + output_tokens,
    )


def input_items(req: ResponsesRequest) -> tuple[dict[str, Any], ...]:
    """The request's input as OpenAI lists a response's input items: text is one user message; every item has an id."""
    if isinstance(req.input, str):
        items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": req.input}]}]
    else:
        items = [item.model_dump(exclude_none=True) for item in req.input]
    prefixes = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
    for item in items:
        if isinstance(item.get("content"), str):
            item["content"] = [{"type": "input_text" if item.get("role") != "assistant" else "output_text", "text": item["content"]}]
        item.setdefault("id", new_id(prefixes[item["type"]]))
        item.setdefault("status", "completed")
    return tuple(items)


def _keep(job: ResponseJob, store: ResponseStore, items: OutputItems, final: ResponseObject) -> None:
    """The response as answered, its input items, and the conversation with its output as one assistant turn (for a later
    previous_response_id)."""
    if not job.req.store:
        return
    reasoning = "".join(p.text for i in items.items if isinstance(i, ReasoningOutput) for p in i.content)
    content = "".join(p.text for i in items.items if isinstance(i, MessageOutput) for p in i.content)
    calls = [ToolCall(id=i.call_id, function=FunctionCall(name=i.name, arguments=i.arguments)) for i in items.items if isinstance(i, FunctionCallOutput)]
    reply = ChatMessage(role="assistant", content=content, reasoning_content=reasoning or None, tool_calls=calls or None)
    store.put(job.response_id, StoredResponse(final.model_dump(), (*job.messages, reply), input_items(job.req)))


def _status(finish_reason: str | None) -> Status:
    return "incomplete" if finish_reason == "length" else "completed"


async def whole_response(s: ServedModel, job: ResponseJob, store: ResponseStore) -> ResponseObject:
    (result,) = await final_outputs(s.frontend, job.response_id, [job.chat.job])
    (c,) = result.outputs
    items = OutputItems()
    _feed(items, job.chat.parser(), c.text, True, c.stop_reason)
    status = _status(c.finish_reason)
    items.finish(status)
    usage = await _usage(s, job, items, len(c.token_ids), result.num_cached_tokens)
    final = _response(job, s, items, status, usage)
    _keep(job, store, items, final)
    return final


async def open_response_stream(s: ServedModel, job: ResponseJob, store: ResponseStore) -> tuple[AsyncGenerator[bytes, None], Updates]:
    """The engine request added (a refusal is still a plain HTTP error), and the events that will stream its output."""
    updates = await open_updates(s.frontend, job.response_id, [job.chat.job], OutputKind.DELTA)
    return response_stream(s, job, store, updates), updates


def _sse(event: Event, sequence: Iterator[int]) -> bytes:
    event["sequence_number"] = next(sequence)
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


def _error_event(e: Exception) -> Event:
    error = e if isinstance(e, APIError) else frontend_error(e)
    if error is None:
        log.exception("error while streaming a response", exc_info=e)
        error = APIError(400 if isinstance(e, ValueError) else 500, str(e) if isinstance(e, ValueError) else f"internal server error: {type(e).__name__}")
    return {"type": "error", "code": error.code, "message": error.message, "param": error.param}


async def response_stream(s: ServedModel, job: ResponseJob, store: ResponseStore, updates: Updates) -> AsyncGenerator[bytes, None]:
    sequence = itertools.count()
    started = _response(job, s).model_dump()
    yield _sse({"type": "response.created", "response": started}, sequence)
    yield _sse({"type": "response.in_progress", "response": started}, sequence)
    items, parser = OutputItems(), job.chat.parser()
    output_tokens, cached, finish = 0, 0, None
    try:
        async for _, update in updates:
            cached = max(cached, update.num_cached_tokens)
            for d in update.outputs:
                output_tokens += len(d.token_ids)
                finish = d.finish_reason or finish
                for event in _feed(items, parser, d.text, d.finish_reason is not None, d.stop_reason):
                    yield _sse(event, sequence)
        status = _status(finish)
        for event in items.finish(status):
            yield _sse(event, sequence)
        final = _response(job, s, items, status, await _usage(s, job, items, output_tokens, cached))
        _keep(job, store, items, final)
        # response.completed also when max_output_tokens cut the reply (its status says "incomplete"), as vLLM does: the
        # openai client's stream helper and the Agents SDK wait for response.completed and fail on response.incomplete
        yield _sse({"type": "response.completed", "response": final.model_dump()}, sequence)
    except Exception as e:
        yield _sse(_error_event(e), sequence)
    finally:
        await updates.aclose()
