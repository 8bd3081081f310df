"""The request body of `POST /v1/responses` (OpenAI's Responses API), as pydantic models that validate it. Not to be confused
with api/responses.py, the wire format of what the chat and completions routes answer.

Like every request model here it forbids undeclared fields (a 400 naming the field). The declared fields are honoured, or
accepted only at the value that means what openk3 does anyway, with a 400 saying why for any other value (docs/serving.md,
"Responses API"): nothing a client sends is silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag

from openk3.api.protocol import INT64_MAX, Int, ToolName

ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


def _refused(why: str) -> AfterValidator:
    """A field accepted only when absent (null): any value is a 400 saying why openk3 cannot honour it."""

    def check(value: object) -> object:
        if value is not None:
            raise ValueError(f"is not supported: {why}")
        return value

    return AfterValidator(check)


def _only(accepted: object, why: str) -> AfterValidator:
    def check(value: object) -> object:
        if value is not None and value != accepted:
            raise ValueError(f"only {accepted!r} is supported: {why}")
        return value

    return AfterValidator(check)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class InputImage(_Strict):
    """An image in a user message: a base64 `data:` URL (api/images.py); a stored file is refused (this server stores none)."""

    type: Literal["input_image"]
    image_url: str | None = None
    detail: Literal["auto", "low", "high"] = "auto"
    file_id: Annotated[str | None, _refused("this server stores no files: send the image as a data: URL in image_url")] = None


class OutputText(_Strict):
    """An earlier assistant message's text, as a client sends it back (its annotations and logprobs are not prompt)."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


class Refusal(_Strict):
    type: Literal["refusal"]
    refusal: str


class MessageItem(_Strict):
    """A message: `{"role", "content"}` (OpenAI's EasyInputMessage has no type) or `{"type": "message", ...}`. Text parts,
    and images in user messages (for a model with a vision tower); files and audio are refused."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Annotated[InputText | InputImage | OutputText | Refusal, Field(discriminator="type")]]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class SummaryText(_Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningText(_Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Strict):
    """An earlier turn's reasoning, as this server returned it: its `content` is the reasoning text itself. A summary-only
    item (another server's) is still taken, its summary standing for the reasoning; encrypted reasoning cannot be read."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: Annotated[str | None, _refused("openk3 cannot decrypt another server's reasoning; send its content or summary")] = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_type(value: Any) -> str:
    """An item's kind: its `type`, or "message" for OpenAI's EasyInputMessage, which has none."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if isinstance(kind, str) else "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(_Strict):
    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(_Strict):
    type: Literal["function"]
    name: ToolName


class TextFormat(_Strict):
    """`text.format`: plain text, any JSON object, or JSON matching `schema` (the same structured-output path as chat's
    response_format; `strict` either way: the schema is always enforced)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # handed to the chat template where it reads it, else a 400


class ReasoningConfig(_Strict):
    effort: ReasoningEffort | None = None  # as chat's reasoning_effort (api/jobs.py template_kwargs)
    summary: Annotated[str | None, _refused("openk3 returns the reasoning text itself (reasoning items' content), not a summary")] = None
    generate_summary: Annotated[str | None, _refused("openk3 returns the reasoning text itself, not a summary")] = None


class StreamOptions(_Strict):
    include_obfuscation: Annotated[bool | None, _only(False, "openk3 does not pad stream events")] = None


ToolChoice = Literal["none", "auto", "required"] | NamedFunctionChoice


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True  # kept in the server's bounded in-memory store, for previous_response_id (api/responses_store.py)
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Int | None = Field(default=None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    # accepted no-ops, as on chat (api/protocol.py NOOP_FIELDS): the caller's own bookkeeping; metadata is echoed back
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: Literal["auto", "default"] | None = None
    truncation: Annotated[str | None, _only("disabled", "a conversation longer than the context is a 400, never cut")] = None
    include: Annotated[list[str] | None, _only([], "openk3 adds nothing optional to a response (no logprobs, no encrypted reasoning)")] = None
    background: Annotated[bool | None, _only(False, "responses run while the request is open")] = None
    top_logprobs: Annotated[int | None, _refused("use /v1/chat/completions for logprobs")] = None
    max_tool_calls: Annotated[int | None, _refused("use parallel_tool_calls: false for at most one call per response")] = None
    conversation: Annotated[Any, _refused("there are no stored conversations; use previous_response_id")] = None
    prompt: Annotated[Any, _refused("there are no stored prompt templates; send input and instructions")] = None
    context_management: Annotated[Any, _refused("a conversation is never compacted")] = None
    prompt_cache_retention: Annotated[Any, _refused("the prefix cache keeps what fits in its memory, with no retention promise")] = None
