"""What `POST /v1/responses` answers: the Response object and its output items (reasoning, message, function_call), and
`OutputItems`, which turns a reply's parsed pieces (api/agent_output.py) into those items and into the typed stream events
that build them, in OpenAI's order:

    response.created, response.in_progress,
    per item: response.output_item.added,
      reasoning: response.content_part.added, response.reasoning_text.delta ..., response.reasoning_text.done, response.content_part.done
      message:   response.content_part.added, response.output_text.delta ..., response.output_text.done, response.content_part.done
      function_call: response.function_call_arguments.delta ..., response.function_call_arguments.done
    response.output_item.done,
    response.completed (its response's status "incomplete" when max_output_tokens cut the reply).

A whole response runs the same `OutputItems` over the whole reply (its events unused), so a stream's items are the whole
response's items. Each event carries a `sequence_number`, counted by the stream (api/responses_run.py).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from openk3.api.responses import DeltaToolCall

Event = dict[str, Any]
Status = Literal["in_progress", "completed", "incomplete"]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ReasoningContent(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str = ""


class ReasoningOutput(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: new_id("rs"))
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningContent] = Field(default_factory=list)
    status: Status = "in_progress"


class OutputTextContent(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] = Field(default_factory=list)


class MessageOutput(BaseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: new_id("msg"))
    role: Literal["assistant"] = "assistant"
    content: list[OutputTextContent] = Field(default_factory=list)
    status: Status = "in_progress"


class FunctionCallOutput(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: new_id("fc"))
    call_id: str
    name: str
    arguments: str = ""
    status: Status = "in_progress"


OutputItem = ReasoningOutput | MessageOutput | FunctionCallOutput


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """OpenAI's Response; the request's settings are echoed back as OpenAI echoes them."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    model: str
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    output: list[OutputItem] = Field(default_factory=list)
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=dict)
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None


class OutputItems:
    """One reply's output items, built from its pieces in order; `feed` returns the stream events of what it settled."""

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None
        self._calls: dict[int, FunctionCallOutput] = {}  # the parser's call index -> its item

    def feed(self, reasoning: str = "", content: str = "", tool_calls: list[DeltaToolCall] | None = None) -> list[Event]:
        events: list[Event] = []
        if reasoning:
            events += self._text(ReasoningOutput, reasoning)
        if content:
            events += self._text(MessageOutput, content)
        for piece in tool_calls or ():
            events += self._call(piece)
        return events

    def finish(self, status: Status) -> list[Event]:
        """Close the open item; a reply with no text and no calls still answers with one (empty) message."""
        events = [] if self.items else self._text(MessageOutput, "")
        events += self._close(status)
        return events

    def _index(self, item: OutputItem) -> int:
        return self.items.index(item)

    def _add(self, item: OutputItem) -> list[Event]:
        events = self._close("completed")
        self.items.append(item)
        self._open = item
        events.append({"type": "response.output_item.added", "output_index": self._index(item), "item": item.model_dump()})
        return events

    def _text(self, kind: type[ReasoningOutput] | type[MessageOutput], text: str) -> list[Event]:
        events: list[Event] = []
        item = self._open
        if not isinstance(item, kind):
            item = kind()
            events += self._add(item)
            part: ReasoningContent | OutputTextContent = ReasoningContent() if kind is ReasoningOutput else OutputTextContent()
            item.content.append(part)  # type: ignore[arg-type]  # the part's kind is the item's
            events.append({**self._where(item), "type": "response.content_part.added", "part": part.model_dump()})
        item.content[0].text += text
        name = "response.reasoning_text.delta" if kind is ReasoningOutput else "response.output_text.delta"
        if text:
            events.append({**self._where(item), "type": name, "delta": text, **({} if kind is ReasoningOutput else {"logprobs": []})})
        return events

    def _where(self, item: OutputItem) -> Event:
        return {"item_id": item.id, "output_index": self._index(item), "content_index": 0}

    def _call(self, piece: DeltaToolCall) -> list[Event]:
        events: list[Event] = []
        if piece.id is not None:
            call = FunctionCallOutput(call_id=piece.id, name=piece.function.name or "")
            self._calls[piece.index] = call
            events += self._add(call)
        call = self._calls[piece.index]
        delta = piece.function.arguments or ""
        call.arguments += delta
        if delta:
            events.append({"type": "response.function_call_arguments.delta", "item_id": call.id, "output_index": self._index(call), "delta": delta})
        return events

    def _close(self, status: Status) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        events: list[Event] = []
        if isinstance(item, FunctionCallOutput):
            where = {"item_id": item.id, "output_index": self._index(item)}
            events.append({"type": "response.function_call_arguments.done", **where, "name": item.name, "arguments": item.arguments})
        else:
            part = item.content[0]
            if isinstance(item, ReasoningOutput):
                events.append({**self._where(item), "type": "response.reasoning_text.done", "text": part.text})
            else:
                events.append({**self._where(item), "type": "response.output_text.done", "text": part.text, "logprobs": []})
            events.append({**self._where(item), "type": "response.content_part.done", "part": part.model_dump()})
        events.append({"type": "response.output_item.done", "output_index": self._index(item), "item": item.model_dump()})
        return events
