"""The OpenAI wire format of what clients send, as pydantic models that validate it (responses: api/responses.py).

Requests accept the OpenAI fields plus vLLM's sampling extensions (top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, ...). Every model forbids fields it does not declare: a field the server would not honour is a 400 naming
it (pydantic's `extra_forbidden`, param = the field), never a 200 that drops it. A few OpenAI fields that cannot change an
answer are declared as accepted no-ops (`NOOP_FIELDS`, docs/serving.md "Agent API"). Bounds that would otherwise reach torch
as an overflow (seeds, token ids, top_k) are checked here, so that every bad value becomes a 400 naming the field.
SGLang-only fields that sglang-router puts on every request it forwards are accepted at the values that mean what openk3
does anyway (`ROUTER_FIELDS`, docs/scale-out.md, the sglang-router section); any other value is a 400 saying why.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

INT64_MAX = 2**63 - 1
MAX_LOGPROBS = 20  # OpenAI's and vLLM's cap on alternatives per token
MAX_N = 128

# strict: JSON true is not the integer 1 (pydantic's lax mode would take it as one, silently)
TokenId = Annotated[int, Field(strict=True, ge=0, le=2**31 - 1)]
Int = Annotated[int, Field(strict=True)]


# tool names as OpenAI allows them, plus dots (MCP servers name tools `server.tool`); no ':' or quotes, which the Kimi formats
# use around the name
ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
# OpenAI fields that cannot change an answer, accepted and not acted on (docs/serving.md lists them with the reason)
NOOP_FIELDS = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key")
# sglang-router compatibility. sglang-router 0.3.0-0.3.2 (sgl-model-gateway: src/protocols/chat.rs, completion.rs) parses
# each request into its own serde model and forwards it re-serialised (src/routers/http/router.rs, send_typed_request), so
# these SGLang fields arrive on every request at SGLang's defaults, whether the client sent them or not (and chat's
# `max_tokens` arrives as `max_completion_tokens`). `no_stop_trim` is honoured (true keeps the stop string or stop token's
# text, as include_stop_str_in_output); the others are accepted only at the value that is what openk3 does anyway.
ROUTER_FIELDS = ("no_stop_trim", "return_hidden_states", "continue_final_message", "separate_reasoning", "stream_reasoning")


def _only(accepted: bool, why: str) -> AfterValidator:
    """A router-compatibility flag: the one value openk3 honours, anything else a 400 saying why."""

    def check(value: bool) -> bool:
        if value is not accepted:
            raise ValueError(f"only {str(accepted).lower()} is supported: {why}")
        return value

    return AfterValidator(check)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk also carries the usage so far (its choice's prompt and completion tokens)
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`; `strict` is accepted either way: the schema is always enforced."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs` (StructuredOutputsParams): exactly one of the kinds; whitespace as in docs/serving.md."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF in xgrammar's syntax
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None  # xgrammar's structural tag
    disable_any_whitespace: bool | None = None  # None / True: compact JSON; False: any whitespace between tokens


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None  # None: the served model (vLLM's leniency; the openai client always sends one)
    n: Int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Int | None = Field(default=None, ge=-(2**63), le=INT64_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias added to its logit (api/token_fields.py)
    # vLLM's: each prompt token's logprob with this many alternatives, scored in the prefill (serve/prompt_logprobs.py)
    prompt_logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # accepted no-ops (NOOP_FIELDS): identifiers and tags for the caller's own bookkeeping; nothing is stored, so `store`
    # may only be false and `service_tier` only ask for the one tier there is
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: Literal[False] | None = None
    service_tier: Literal["auto", "default"] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # the prefix cache keys on the tokens themselves
    # vLLM extensions
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: Int | None = Field(default=None, ge=1, le=INT64_MAX)
    # vLLM's: lower is served first under --scheduling-policy priority or fair; other than 0 a 400 under fcfs (api/jobs.py)
    priority: Int = Field(default=0, ge=-(2**63), le=INT64_MAX)
    cache_salt: str | None = Field(default=None, min_length=1)  # only requests with the same salt share cached prefixes
    modalities: list[Literal["text"]] | None = None  # OpenAI's: text is the only output openk3 has
    top_k: Int | None = Field(default=None, ge=-1, le=2**31 - 1)
    min_p: float = Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = Field(default=1.0, gt=0, le=100)
    min_tokens: Int = Field(default=0, ge=0, le=INT64_MAX)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # structured output (docs/serving.md "Structured output"): vLLM's structured_outputs and its older guided_* fields, and
    # on chat OpenAI's response_format (legacy completions have none); at most one of them per request
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # sglang-router compatibility (ROUTER_FIELDS)
    no_stop_trim: bool = False  # SGLang's name for include_stop_str_in_output: either one true keeps the stop text
    return_hidden_states: Annotated[bool, _only(False, "openk3 does not return hidden states")] = False


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int | None = Field(default=16, ge=0, le=INT64_MAX)  # 0: with echo, score the prompt without generating (vLLM)
    logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: Int | None = Field(default=None, ge=1, le=MAX_N)
    # for RL trainers (docs/rollouts.md), not in a stream: vLLM's return_token_ids (each choice's prompt and completion ids,
    # exactly as run) and SGLang's return_routed_experts (each MoE layer's top-k experts per token run: serve/routing.py)
    return_token_ids: bool = False
    return_routed_experts: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")  # api/chat.py refuses every part but text, naming the part and its type
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON text, as OpenAI sends and returns it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns: the call this is the result of
    reasoning_content: str | None = None  # assistant turns: the reasoning the server returned (vLLM also says `reasoning`)
    reasoning: str | None = None
    refusal: None = None  # what the openai client may echo back from a response; only its empty value
    function_call: None = None
    audio: None = None  # a reference to an earlier audio reply: openk3 has none, so only null
    annotations: list[dict[str, Any]] | None = None  # citations of an earlier reply (OpenAI's): not part of the prompt


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments always match `parameters` when a call is enforced (api/tool_choice.py)


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: ToolName


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(default=None, ge=1, le=INT64_MAX)
    max_completion_tokens: Int | None = Field(default=None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None  # checked by the chat renderer: K3 takes low / high / max, or none (thinking off)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # OpenAI's; handed to a Jinja chat template that reads it, as vLLM does (api/jobs.py), else a 400 naming it
    verbosity: Literal["low", "medium", "high"] | None = None
    # sglang-router compatibility (ROUTER_FIELDS): reasoning is always returned apart (`reasoning_content`) where the chat
    # format has a reasoning block, and streamed as it settles; the last message is always a finished turn
    continue_final_message: Annotated[bool, _only(False, "openk3 always renders the last message as a finished turn and starts a new assistant reply")] = False
    separate_reasoning: Annotated[
        bool, _only(True, "openk3 always returns reasoning apart from the content, in reasoning_content, when the chat format has a reasoning block")
    ] = True
    stream_reasoning: Annotated[bool, _only(True, "openk3 streams reasoning_content as it is generated")] = True


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt (as completions encode it), False for messages (the template has them)
    # with messages, vLLM's chat fields: the prompt is rendered exactly as /v1/chat/completions renders it
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    tools: list[Tool] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]
