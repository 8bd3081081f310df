"""The OpenAI wire format of what the server answers, as pydantic models built and then dumped: errors, usage, completion
and chat responses, stream chunks (with OpenAI's piecewise tool calls), the model list. Requests are in api/protocol.py."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from openk3.api.protocol import ToolCall


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's `prompt_logprobs` entry of one token: keyed by token id (as a string in JSON)."""

    logprob: float
    rank: int | None = None
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # one per prompt token; None for the first (nothing before it)


class RoutedExperts(BaseModel):
    """A completion's routing (serve/routing.py RoutingTrace): experts[t][l][j], the j-th expert of MoE layer layers[l] for
    position t, over the prompt and the completion but its last token."""

    layers: list[int]
    experts: list[list[list[int]]]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] | None = None  # with return_token_ids
    routed_experts: RoutedExperts | None = None  # with return_routed_experts
    weight_version: int | None = None  # the engine's weight version this choice was sampled with (routes/weights.py)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None
    weight_version: int | None = None  # the engine's weight version the choices were sampled with (routes/weights.py)


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _drop_nones(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaToolCall(BaseModel):
    """One streamed piece of a tool call, as OpenAI streams them: the first with id, type and name (arguments ""), then the
    arguments; unset fields are left out rather than sent as null."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer(mode="wrap")
    def _drop_nones(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    weight_version: int | None = None  # on the chunk that ends a choice and on the usage chunk, as in a whole response


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "openk3"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
