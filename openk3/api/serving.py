"""`/v1/completions` and `/v1/chat/completions`: validated request -> engine jobs -> a JSON response or an SSE stream.

Streams follow OpenAI: `data: <json>\\n\\n` events ending with `data: [DONE]\\n\\n`; chat streams open each choice with a
`delta.role` chunk; `stream_options.include_usage` adds a final chunk with empty choices and the usage; an error after the
stream has started is sent as `data: {"error": ...}` before `[DONE]`. Choice indices are prompt_index * n + sample_index.
Chat replies in a Kimi format go through one `ChoiceParser` per choice (api/agent_output.py): `reasoning_content`, content
and `tool_calls`, whole or as `delta.reasoning_content` / `delta.content` / `delta.tool_calls` pieces.
"""

from __future__ import annotations

import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from pydantic import BaseModel

from openk3.api.agent_output import ChoiceParser, call_deltas
from openk3.api.chat import ChatTemplate
from openk3.api.chat_format import PromptEnd, forced_call_prefix, prompt_end
from openk3.api.errors import APIError, frontend_error
from openk3.api.generation import (
    EngineJob,
    StructuredRequest,
    TokenTexts,
    Updates,
    check_prompt,
    compile_structured,
    final_outputs,
    open_updates,
    sampling_params,
    structured_request,
    usage,
)
from openk3.api.limits import RequestLimits
from openk3.api.prompt_text import PromptEncoder
from openk3.api.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ToolCall,
)
from openk3.api.tool_choice import ToolPlan, plan_tools, required_call_prefix, structured_reply_prefix
from openk3.serve.frontend import AsyncEngine
from openk3.serve.output import OutputKind
from openk3.serve.structured.compiler import GrammarCompiler
from openk3.serve.structured.spec import Grammar
from openk3.serve.tokenizer import Tokenizer

log = logging.getLogger("openk3.api")
MAX_CHOICES = 256  # prompts x n in one request


@dataclass(frozen=True)
class Served:
    """What the handlers need of the running server; fixed for its lifetime."""

    frontend: AsyncEngine
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    model_name: str
    model_root: str
    max_model_len: int
    vocab_size: int
    texts: TokenTexts
    encoder: PromptEncoder  # text -> token ids on its own threads, after the size check
    limits: RequestLimits = field(default_factory=RequestLimits)
    stop_token_ids: tuple[int, ...] = ()  # the checkpoint's end tokens (generation_config.json), for every request
    chat_stop: tuple[str, ...] = ()  # the chat template's end of turn, when it is text
    chat_stop_token_ids: tuple[int, ...] = ()  # ... or when it is one special token

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """Structured-output grammars for this tokenizer, compiled once per spec (built on first use, on a worker thread)."""
        # the model's vocabulary (the logits width), which may run past the tokenizer's ids (`vocab_size` is the smaller)
        return GrammarCompiler(self.tokenizer, self.frontend.engine.model_config.vocab_size)

    async def grammar(self, req: CompletionRequest | ChatCompletionRequest) -> Grammar | None:
        asked = structured_request(req)
        return None if asked is None else await self.encoder.run(lambda: compile_structured(self.grammars, asked))

    def special_tokens(self) -> dict[str, str]:
        tok, out = self.tokenizer, {}
        for name, token_id in (("bos_token", tok.bos_token_id), ("eos_token", tok.eos_token_id)):
            out[name] = "" if token_id is None else tok.decode([token_id], skip_special_tokens=False)
        return out

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True, kwargs: dict | None = None, tools: list[dict] | None = None) -> str:
        if not messages:
            raise APIError(400, "messages is empty: expected at least one message", param="messages", code="invalid_value")
        try:
            self.chat_template.check_kwargs(kwargs)
        except ValueError as e:
            raise APIError(400, str(e), param="chat_template_kwargs", code="unsupported") from e
        try:
            return self.chat_template.render(messages, add_generation_prompt, self.special_tokens(), kwargs, tools)
        except ValueError as e:
            raise APIError(400, str(e), param="messages", code="invalid_value") from e


@dataclass(frozen=True)
class ChatJob:
    """A chat request's engine job and what its replies are parsed with (nothing without a Kimi chat format)."""

    job: EngineJob
    plan: ToolPlan
    end: PromptEnd | None = None  # the block the prompt left open
    forced_prefix: str = ""  # written into the prompt to force a call; the parser reads it as the reply's start

    def parser(self) -> ChoiceParser | None:
        return None if self.end is None else ChoiceParser(self.plan, self.end, self.forced_prefix)


def sse(payload: BaseModel | dict) -> bytes:
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return b"data: " + data.encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def _stream_error(e: Exception) -> bytes:
    if isinstance(e, APIError):
        return sse(e.body())
    unavailable = frontend_error(e)
    if unavailable is not None:
        return sse(unavailable.body())
    status = 400 if isinstance(e, ValueError) else 500
    if status == 500:
        log.exception("error while streaming", exc_info=e)
    return sse(APIError(status, str(e)).body())


async def completion_jobs(s: Served, req: CompletionRequest) -> tuple[list[EngineJob], list[str]]:
    s.limits.check(req)
    if req.suffix:
        raise APIError(400, "suffix is not supported by this server", param="suffix", code="unsupported")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, f"best_of={req.best_of} is not supported: only best_of equal to n ({req.n})", param="best_of", code="unsupported")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported (prompt logprobs are not computed)", param="echo", code="unsupported")
    p = req.prompt
    prompts: list[str | list[int]] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)  # type: ignore[arg-type]
    if not prompts:
        raise APIError(400, "prompt is empty: expected a string, a list of strings or token ids", param="prompt", code="invalid_value")
    if len(prompts) * req.n > MAX_CHOICES:
        raise APIError(400, f"{len(prompts)} prompts x n={req.n} is more than {MAX_CHOICES} choices", param="n", code="invalid_value")
    grammar = await s.grammar(req)
    jobs, texts = [], []
    for prompt in prompts:
        ids = await s.encoder.encode(prompt, "prompt", add_special_tokens=True) if isinstance(prompt, str) else list(prompt)  # vLLM: BOS for text
        max_tokens = check_prompt(ids, s.vocab_size, s.max_model_len, req.max_tokens, "prompt", "max_tokens")
        jobs.append(EngineJob(ids, sampling_params(req, max_tokens, req.logprobs, extra_stop_ids=s.stop_token_ids, grammar=grammar)))
        texts.append(prompt if isinstance(prompt, str) else await s.encoder.run(functools.partial(s.tokenizer.decode, ids)))
    return jobs, texts


async def chat_job(s: Served, req: ChatCompletionRequest) -> ChatJob:
    s.limits.check(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs", code="invalid_value")
    template = s.chat_template
    plan = plan_tools(req, template.format, template.uses_tools)
    tools = plan.template_tools()
    text = await s.encoder.run(lambda: s.render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs, tools))
    end = None if plan.fmt is None else prompt_end(plan.fmt, text)
    grammar = await s.grammar(req)
    forced = ""
    calls_before = sum(len(m.tool_calls or ()) for m in req.messages)
    if plan.fmt is not None and end is not None:
        if plan.forced is not None:
            forced = forced_call_prefix(plan.fmt, end, plan.forced, calls_before)
        elif plan.required:
            forced = required_call_prefix(plan.fmt, end)
        elif grammar is not None:
            forced = structured_reply_prefix(plan.fmt, end)
        call = plan.call_grammar(calls_before)
        if call is not None:
            grammar = await s.encoder.run(lambda: compile_structured(s.grammars, StructuredRequest("tools", call)))
    ids = await s.encoder.encode(text + forced, "messages")
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = check_prompt(ids, s.vocab_size, s.max_model_len, asked, "messages", param)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    stop_ids = s.stop_token_ids + s.chat_stop_token_ids
    call_stop = plan.call_stop()
    stops = s.chat_stop + ((call_stop,) if call_stop is not None else ())
    # the parsers read the format's markers, which a Kimi tokenizer has as special tokens: keep them in the text
    skip = None if plan.fmt is None else False
    params = sampling_params(req, max_tokens, logprobs, extra_stop=stops, extra_stop_ids=stop_ids, skip_special_tokens=skip, grammar=grammar)
    return ChatJob(EngineJob(ids, params), plan, end, forced)


async def completion_response(s: Served, req: CompletionRequest, jobs: list[EngineJob], texts: list[str]) -> CompletionResponse:
    request_id = f"cmpl-{uuid.uuid4().hex}"
    results = await final_outputs(s.frontend, request_id, jobs)
    out = []
    for i, result in enumerate(results):
        for c in result.outputs:
            echo = texts[i] if req.echo else ""
            logprobs = s.texts.completion_logprobs(c.logprobs or (), 0)[0] if req.logprobs is not None else None
            choice = CompletionChoice(
                index=i * req.n + c.index, text=echo + c.text, logprobs=logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason
            )
            out.append(choice)
    prompt_tokens = sum(len(j.prompt_token_ids) for j in jobs)
    completion_tokens = sum(len(c.token_ids) for r in results for c in r.outputs)
    u = usage(prompt_tokens, completion_tokens, sum(r.num_cached_tokens for r in results))
    return CompletionResponse(id=request_id, model=s.model_name, choices=out, usage=u)


async def open_completion_stream(s: Served, req: CompletionRequest, jobs: list[EngineJob], texts: list[str]) -> tuple[AsyncGenerator[bytes, None], Updates]:
    """The engine requests added (a refusal is still a plain HTTP error), and the events that will stream their outputs."""
    request_id = f"cmpl-{uuid.uuid4().hex}"
    updates = await open_updates(s.frontend, request_id, jobs, OutputKind.DELTA)
    return completion_stream(s, req, jobs, texts, request_id, updates), updates


async def completion_stream(
    s: Served, req: CompletionRequest, jobs: list[EngineJob], texts: list[str], request_id: str, updates: Updates
) -> AsyncGenerator[bytes, None]:
    created = int(time.time())
    offsets: dict[int, int] = {}
    completion_tokens, cached = 0, dict[int, int]()
    try:
        async for i, update in updates:
            cached[i] = max(cached.get(i, 0), update.num_cached_tokens)
            for d in update.outputs:
                index = i * req.n + d.index
                completion_tokens += len(d.token_ids)
                text = d.text
                if index not in offsets:
                    offsets[index] = 0
                    text = (texts[i] if req.echo else "") + text
                if not text and d.finish_reason is None and not d.token_ids:
                    continue  # one chunk per step that made tokens, even when their text is held back or empty
                logprobs = None
                if req.logprobs is not None:
                    logprobs, offsets[index] = s.texts.completion_logprobs(d.logprobs or (), offsets[index])
                choice = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=d.finish_reason, stop_reason=d.stop_reason)
                yield sse(CompletionResponse(id=request_id, created=created, model=s.model_name, choices=[choice]))
        if req.stream_options is not None and req.stream_options.include_usage:
            prompt_tokens = sum(len(j.prompt_token_ids) for j in jobs)
            u = usage(prompt_tokens, completion_tokens, sum(cached.values()))
            yield sse(CompletionResponse(id=request_id, created=created, model=s.model_name, choices=[], usage=u))
    except Exception as e:
        yield _stream_error(e)
    finally:
        await updates.aclose()
    yield DONE


async def chat_response(s: Served, req: ChatCompletionRequest, chat: ChatJob) -> ChatCompletionResponse:
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    job = chat.job
    (result,) = await final_outputs(s.frontend, request_id, [job])
    out = []
    for c in result.outputs:
        logprobs = s.texts.chat_logprobs(c.logprobs or ()) if req.logprobs else None
        finish = c.finish_reason
        parser = chat.parser()
        if parser is None:
            message = ChatResponseMessage(content=c.text)
        else:
            piece = parser.feed(c.text, final=True, stop_reason=c.stop_reason)
            calls: list[ToolCall] | None = piece.calls or None
            content = None if calls and not piece.content else piece.content
            message = ChatResponseMessage(content=content, reasoning_content=piece.reasoning if parser.has_reasoning else None, tool_calls=calls)
            finish = parser.finish_reason(finish)
        out.append(ChatChoice(index=c.index, message=message, logprobs=logprobs, finish_reason=finish, stop_reason=c.stop_reason))
    completion_tokens = sum(len(c.token_ids) for c in result.outputs)
    u = usage(len(job.prompt_token_ids), completion_tokens, result.num_cached_tokens)
    return ChatCompletionResponse(id=request_id, model=s.model_name, choices=out, usage=u)


async def open_chat_stream(s: Served, req: ChatCompletionRequest, chat: ChatJob) -> tuple[AsyncGenerator[bytes, None], Updates]:
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    updates = await open_updates(s.frontend, request_id, [chat.job], OutputKind.DELTA)
    return chat_stream(s, req, chat, request_id, updates), updates


def _chat_deltas(parser: ChoiceParser | None, text: str, finished: bool, stop_reason: int | str | None) -> list[DeltaMessage]:
    """One step's text as the deltas to send: reasoning, then content, then each completed call's two pieces."""
    if parser is None:
        return [DeltaMessage(content=text)]
    piece = parser.feed(text, final=finished, stop_reason=stop_reason)
    out = []
    if piece.reasoning:
        out.append(DeltaMessage(reasoning_content=piece.reasoning))
    if piece.content:
        out.append(DeltaMessage(content=piece.content))
    out += [DeltaMessage(tool_calls=calls) for calls in call_deltas(piece.calls, parser.num_calls - len(piece.calls))]
    return out or [DeltaMessage(content="")]


async def chat_stream(s: Served, req: ChatCompletionRequest, chat: ChatJob, request_id: str, updates: Updates) -> AsyncGenerator[bytes, None]:
    created = int(time.time())
    job = chat.job

    def chunk(choices: list[ChatChunkChoice], u=None) -> bytes:
        return sse(ChatCompletionChunk(id=request_id, created=created, model=s.model_name, choices=choices, usage=u))

    completion_tokens, cached, opened = 0, 0, set()
    parsers: dict[int, ChoiceParser | None] = {}
    try:
        async for _, update in updates:
            cached = max(cached, update.num_cached_tokens)
            for d in update.outputs:
                completion_tokens += len(d.token_ids)
                if d.index not in opened:  # as vLLM: the role chunk comes with the first output, so it marks the first token
                    opened.add(d.index)
                    parsers[d.index] = chat.parser()
                    yield chunk([ChatChunkChoice(index=d.index, delta=DeltaMessage(role="assistant", content=""))])
                if not d.text and d.finish_reason is None and not d.token_ids:
                    continue
                logprobs = s.texts.chat_logprobs(d.logprobs or ()) if req.logprobs else None
                parser = parsers[d.index]
                deltas = _chat_deltas(parser, d.text, d.finish_reason is not None, d.stop_reason)
                finish = d.finish_reason if parser is None else parser.finish_reason(d.finish_reason)
                for k, delta in enumerate(deltas):  # logprobs ride on the first piece, the finish reason on the last
                    last = k == len(deltas) - 1
                    choice = ChatChunkChoice(
                        index=d.index,
                        delta=delta,
                        logprobs=logprobs if k == 0 else None,
                        finish_reason=finish if last else None,
                        stop_reason=d.stop_reason if last else None,
                    )
                    yield chunk([choice])
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunk([], usage(len(job.prompt_token_ids), completion_tokens, cached))
    except Exception as e:
        yield _stream_error(e)
    finally:
        await updates.aclose()
    yield DONE
