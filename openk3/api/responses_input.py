"""A Responses API request as the chat request it means, so that `/v1/responses` runs on the chat path (api/jobs.py
chat_job: the same template, tool plan, grammar and parsers) rather than on a second one.

Input items become chat messages: a message item is a message of its role; an assistant's reasoning item, its text and
its function_call items (in any order up to the next other item) become one assistant message with `reasoning_content`
and `tool_calls`; a function_call_output item is a `tool` message answering its call_id. `instructions` is a system
message in front, and is not carried over by previous_response_id (as OpenAI does). The chat path's errors name chat's
fields; `rename_error` names the Responses fields instead.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

from openk3.api.errors import APIError
from openk3.api.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCall,
)
from openk3.api.responses_request import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    NamedFunctionChoice,
    ReasoningItem,
    ResponsesRequest,
    ToolChoice,
)

# chat's field -> the Responses field that asked for the same thing
CHAT_TO_RESPONSES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
    "verbosity": "text.verbosity",
}
_CHAT_NAMES = re.compile(r"\b(" + "|".join(CHAT_TO_RESPONSES) + r")\b")


def rename_error(e: APIError) -> APIError:
    """The chat path's error with the Responses request's field names, in its param and its message."""
    param = None if e.param is None else CHAT_TO_RESPONSES.get(e.param.split("[")[0], e.param)
    message = _CHAT_NAMES.sub(lambda m: CHAT_TO_RESPONSES[m.group(1)], e.message)
    return APIError(e.status, message, param=param, code=e.code, type=e.type, headers=e.headers)


def _text(item: MessageItem, i: int) -> str:
    if isinstance(item.content, str):
        return item.content
    texts = []
    for j, p in enumerate(item.content):
        if p.type == "input_image":
            raise APIError(400, f"input[{i}].content[{j}]: images are accepted in user messages only", param="input", code="invalid_value")
        texts.append(p.refusal if p.type == "refusal" else p.text)
    return "".join(texts)


def _user_content(item: MessageItem, i: int) -> str | list[ContentPart]:
    """A user message's content as chat parts: its texts, and its images as `image_url` parts (api/images.py reads them)."""
    if isinstance(item.content, str) or all(p.type != "input_image" for p in item.content):
        return _text(item, i)
    parts = []
    for j, p in enumerate(item.content):
        if p.type == "input_image":
            if p.image_url is None:
                raise APIError(400, f"input[{i}].content[{j}].image_url is missing: send the image as a data: URL", param="input", code="invalid_value")
            parts.append(ContentPart.model_validate({"type": "image_url", "image_url": {"url": p.image_url, "detail": p.detail}}))
        else:
            parts.append(ContentPart(type="text", text=p.refusal if p.type == "refusal" else p.text))
    return parts


def _reasoning(item: ReasoningItem) -> str:
    parts = item.content if item.content else item.summary
    return "".join(p.text for p in parts)


class _Conversation:
    """Chat messages built item by item; an assistant's reasoning, text and calls gather into one message."""

    def __init__(self, before: Sequence[ChatMessage]) -> None:
        self.messages = list(before)
        self.open: ChatMessage | None = None  # the assistant message the next reasoning, text or call joins
        self.calls = {c.id for m in before for c in m.tool_calls or ()}

    def assistant(self) -> ChatMessage:
        if self.open is None:
            self.open = ChatMessage(role="assistant")
            self.messages.append(self.open)
        return self.open

    def add(self, i: int, item: InputItem) -> None:
        if isinstance(item, MessageItem) and item.role == "assistant":
            message = self.assistant()
            if message.content or message.tool_calls:  # a second text after the first, or after calls: a new turn
                self.open = None
                message = self.assistant()
            message.content = _text(item, i)
        elif isinstance(item, MessageItem):
            self.open = None
            content = _user_content(item, i) if item.role == "user" else _text(item, i)
            self.messages.append(ChatMessage(role=item.role, content=content))
        elif isinstance(item, ReasoningItem):
            if self.open is not None and (self.open.content or self.open.tool_calls):
                self.open = None
            self.assistant().reasoning_content = _reasoning(item)
        elif isinstance(item, FunctionCallItem):
            if item.call_id in self.calls:
                raise APIError(400, f"input[{i}].call_id {item.call_id!r} is used by an earlier function_call", param="input", code="invalid_value")
            self.calls.add(item.call_id)
            message = self.assistant()
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            message.tool_calls = [*(message.tool_calls or ()), call]
        else:
            self._output(i, item)

    def _output(self, i: int, item: FunctionCallOutputItem) -> None:
        if item.call_id not in self.calls:
            why = "answers no function_call of the input or of the previous response"
            raise APIError(400, f"input[{i}].call_id {item.call_id!r} {why}", param="input", code="invalid_value")
        self.open = None
        output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
        self.messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=output))


def conversation(req: ResponsesRequest, before: Sequence[ChatMessage]) -> list[ChatMessage]:
    """The conversation so far (`before`: the previous response's, without its instructions) with this request's input."""
    if isinstance(req.input, str):
        return [*before, ChatMessage(role="user", content=req.input)]
    if not req.input and not before:
        raise APIError(400, "input is empty: expected text or at least one item", param="input", code="invalid_value")
    built = _Conversation(before)
    for i, item in enumerate(req.input):
        built.add(i, item)
    return built.messages


def _tool_choice(choice: ToolChoice | None) -> Literal["none", "auto", "required"] | NamedToolChoice | None:
    if isinstance(choice, NamedFunctionChoice):
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return choice


def _response_format(req: ResponsesRequest) -> ResponseFormat | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.name is None:
        raise APIError(400, "text.format.name is required when type is 'json_schema'", param="text.format", code="invalid_value")
    schema = JsonSchemaFormat(name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict)
    return ResponseFormat(type="json_schema", json_schema=schema)


def chat_request(req: ResponsesRequest, messages: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat request with the same meaning: `messages` (the conversation, api/responses_input.conversation) after the
    instructions, and every sampling, tool and format field carried over."""
    system = [ChatMessage(role="system", content=req.instructions)] if req.instructions is not None else []
    tools = [
        Tool(type="function", function=FunctionDefinition(name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
        for t in req.tools or ()
    ]
    return ChatCompletionRequest(
        model=req.model,
        messages=system + messages,
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stream=req.stream,
        tools=tools or None,
        tool_choice=_tool_choice(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=_response_format(req),
        reasoning_effort=req.reasoning.effort if req.reasoning is not None else None,
        verbosity=req.text.verbosity if req.text is not None else None,
        user=req.user,  # the client under --scheduling-policy fair, as on chat
        safety_identifier=req.safety_identifier,
    )
