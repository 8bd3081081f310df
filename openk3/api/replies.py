"""`/v1/completions` and `/v1/chat/completions`, second half: engine outputs -> a JSON response or an SSE stream (the
jobs are built in api/jobs.py).

Streams follow OpenAI: `data: <json>\\n\\n` events ending with `data: [DONE]\\n\\n`; chat streams open each choice with a
`delta.role` chunk; `stream_options.include_usage` adds a final chunk with empty choices and the usage (with vLLM's
`continuous_usage_stats` every chunk also carries its choice's usage so far, as vLLM counts it); an error after the
stream has started is sent as `data: {"error": ...}` before `[DONE]`. The weight version a request ran on rides on the
chunk that ends each choice (and a chat stream's usage chunk), as it rides on a whole response. Choice indices are prompt_index * n + sample_index.
Chat replies in a Kimi format go through one `ChoiceParser` per choice (api/agent_output.py): `reasoning_content`, content
and `tool_calls`, whole or as `delta.reasoning_content` / `delta.content` / `delta.tool_calls` pieces (a call's arguments
in fragments, as they are written).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator

from pydantic import BaseModel

from openk3.api.agent_output import ChoiceParser
from openk3.api.engine_job import EngineJob
from openk3.api.errors import APIError, frontend_error
from openk3.api.jobs import ChatJob
from openk3.api.protocol import ChatCompletionRequest, CompletionRequest, ToolCall
from openk3.api.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    PromptTokensDetails,
    RoutedExperts,
    Usage,
)
from openk3.api.served_model import ServedModel
from openk3.api.updates import Updates, final_outputs, open_updates
from openk3.serve.output import CompletionOutput, OutputKind, RequestOutput

log = logging.getLogger("openk3.api")


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


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def continuous_usage(req: CompletionRequest | ChatCompletionRequest) -> bool:
    """Usage on every chunk. vLLM sends it only with include_usage too and ignores the flag alone; here the flag alone still
    gets what it asks for (never a field silently dropped), without the final usage chunk nobody asked for."""
    return req.stream_options is not None and req.stream_options.continuous_usage_stats


def _first_completion_piece(
    s: ServedModel, req: CompletionRequest, text_echoed: str, prompt: RequestOutput, c: CompletionOutput
) -> tuple[str, CompletionLogprobs | None, int]:
    """A choice's text and logprobs from its start: the echoed prompt (with its logprobs, scored in the prefill) before the
    generated part, which max_tokens=0 leaves out (scoring only); and the text offset the next logprobs start at. `prompt`:
    the output that brought the prompt's logprobs."""
    scoring_only = req.max_tokens == 0
    text = (text_echoed if req.echo else "") + ("" if scoring_only else c.text)
    if req.logprobs is None:
        return text, None, 0
    logprobs, offset = CompletionLogprobs(), 0
    if req.echo:
        logprobs, offset = s.texts.echo_logprobs(prompt.prompt_token_ids, prompt.prompt_logprobs or ())
    if not scoring_only:
        generated, offset = s.texts.completion_logprobs(c.logprobs or (), offset)
        logprobs.tokens += generated.tokens
        logprobs.token_logprobs += generated.token_logprobs
        logprobs.top_logprobs += generated.top_logprobs
        logprobs.text_offset += generated.text_offset
    return text, logprobs, offset


def _routed_experts(c: CompletionOutput) -> RoutedExperts | None:
    if c.routing is None:
        return None
    return RoutedExperts(layers=list(c.routing.layers), experts=c.routing.experts_TLk.tolist())


async def completion_response(s: ServedModel, req: CompletionRequest, jobs: list[EngineJob], texts: list[str]) -> CompletionResponse:
    request_id = f"cmpl-{uuid.uuid4().hex}"
    results = await final_outputs(s.frontend, request_id, jobs)
    out = []
    for i, result in enumerate(results):
        prompt_logprobs = s.texts.prompt_logprobs(result.prompt_logprobs or ()) if req.prompt_logprobs is not None else None
        for c in result.outputs:
            text, logprobs, _ = _first_completion_piece(s, req, texts[i], result, c)
            choice = CompletionChoice(
                index=i * req.n + c.index,
                text=text,
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_logprobs=prompt_logprobs,
                prompt_token_ids=list(result.prompt_token_ids) if req.return_token_ids else None,
                token_ids=([] if req.max_tokens == 0 else list(c.token_ids)) if req.return_token_ids else None,  # as usage counts
                routed_experts=_routed_experts(c) if req.return_routed_experts else None,
                weight_version=result.weight_version,
            )
            out.append(choice)
    prompt_tokens = sum(len(j.prompt_token_ids) for j in jobs)
    completion_tokens = 0 if req.max_tokens == 0 else sum(len(c.token_ids) for r in results for c in r.outputs)
    u = usage(prompt_tokens, completion_tokens, sum(r.num_cached_tokens for r in results))
    return CompletionResponse(id=request_id, model=s.model.name, choices=out, usage=u)


async def open_completion_stream(
    s: ServedModel, req: CompletionRequest, jobs: list[EngineJob], texts: list[str]
) -> tuple[AsyncGenerator[bytes, None], Updates]:
    """The engine requests added (a refusal is still a plain HTTP error), and the events that will stream their outputs."""
    request_id = f"cmpl-{uuid.uuid4().hex}"
    updates = await open_updates(s.frontend, request_id, jobs, OutputKind.DELTA)
    return completion_stream(s, req, jobs, texts, request_id, updates), updates


async def completion_stream(
    s: ServedModel, req: CompletionRequest, jobs: list[EngineJob], texts: list[str], request_id: str, updates: Updates
) -> AsyncGenerator[bytes, None]:
    created = int(time.time())
    offsets: dict[int, int] = {}
    completion_tokens, cached = 0, dict[int, int]()
    per_choice: dict[int, int] = {}  # completion tokens so far, for continuous usage
    every_chunk = continuous_usage(req)
    scores: dict[int, RequestOutput] = {}  # per prompt: the output that brought its prompt logprobs
    try:
        async for i, update in updates:
            cached[i] = max(cached.get(i, 0), update.num_cached_tokens)
            for d in update.outputs:
                index = i * req.n + d.index
                num_new = 0 if req.max_tokens == 0 else len(d.token_ids)
                completion_tokens += num_new
                per_choice[index] = per_choice.get(index, 0) + num_new
                if update.prompt_logprobs is not None:  # they come once per prompt, with its first sample's first output
                    scores[i] = update
                if index not in offsets:
                    text, logprobs, offsets[index] = _first_completion_piece(s, req, texts[i], scores.get(i, update), d)
                else:
                    if not d.text and d.finish_reason is None and not d.token_ids:
                        continue  # one chunk per step that made tokens, even when their text is held back or empty
                    text, logprobs = d.text, None
                    if req.logprobs is not None:
                        logprobs, offsets[index] = s.texts.completion_logprobs(d.logprobs or (), offsets[index])
                version = updates.weight_versions[i] if d.finish_reason is not None else None  # on the choice's last chunk
                choice = CompletionChoice(
                    index=index, text=text, logprobs=logprobs, finish_reason=d.finish_reason, stop_reason=d.stop_reason, weight_version=version
                )
                so_far = usage(len(jobs[i].prompt_token_ids), per_choice[index], cached[i]) if every_chunk else None
                yield sse(CompletionResponse(id=request_id, created=created, model=s.model.name, choices=[choice], usage=so_far))
        if req.stream_options is not None and req.stream_options.include_usage:
            prompt_tokens = sum(len(j.prompt_token_ids) for j in jobs)
            u = usage(prompt_tokens, completion_tokens, sum(cached.values()))
            yield sse(CompletionResponse(id=request_id, created=created, model=s.model.name, choices=[], usage=u))
    except Exception as e:
        yield _stream_error(e)
    finally:
        await updates.aclose()
    yield DONE


async def chat_response(s: ServedModel, req: ChatCompletionRequest, chat: ChatJob) -> ChatCompletionResponse:
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
            calls: list[ToolCall] | None = piece.calls() or None
            content = None if calls and not piece.content else piece.content
            message = ChatResponseMessage(content=content, reasoning_content=piece.reasoning if parser.has_reasoning else None, tool_calls=calls)
            finish = parser.finish_reason(finish)
        out.append(ChatChoice(index=c.index, message=message, logprobs=logprobs, finish_reason=finish, stop_reason=c.stop_reason))
    completion_tokens = sum(len(c.token_ids) for c in result.outputs)
    u = usage(len(job.prompt_token_ids), completion_tokens, result.num_cached_tokens)
    prompt_logprobs = s.texts.prompt_logprobs(result.prompt_logprobs or ()) if req.prompt_logprobs is not None else None
    return ChatCompletionResponse(
        id=request_id, model=s.model.name, choices=out, usage=u, prompt_logprobs=prompt_logprobs, weight_version=result.weight_version
    )


async def open_chat_stream(s: ServedModel, req: ChatCompletionRequest, chat: ChatJob) -> tuple[AsyncGenerator[bytes, None], Updates]:
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    updates = await open_updates(s.frontend, request_id, [chat.job], OutputKind.DELTA)
    return chat_stream(s, req, chat, request_id, updates), updates


def _chat_deltas(parser: ChoiceParser | None, text: str, finished: bool, stop_reason: int | str | None) -> list[DeltaMessage]:
    """One step's text as the deltas to send: reasoning, then content, then the tool-call pieces (a call's opening piece,
    then its argument fragments), one per chunk as OpenAI sends them; none while the parser holds markup back."""
    if parser is None:
        return [DeltaMessage(content=text)]
    piece = parser.feed(text, final=finished, stop_reason=stop_reason)
    out = []
    if piece.reasoning:
        out.append(DeltaMessage(reasoning_content=piece.reasoning))
    if piece.content:
        out.append(DeltaMessage(content=piece.content))
    out += [DeltaMessage(tool_calls=[call]) for call in piece.tool_calls]
    return out


async def chat_stream(s: ServedModel, req: ChatCompletionRequest, chat: ChatJob, request_id: str, updates: Updates) -> AsyncGenerator[bytes, None]:
    created = int(time.time())
    job = chat.job

    (version,) = updates.weight_versions

    def chunk(choices: list[ChatChunkChoice], u=None, ends: bool = False) -> bytes:
        return sse(ChatCompletionChunk(id=request_id, created=created, model=s.model.name, choices=choices, usage=u, weight_version=version if ends else None))

    every_chunk = continuous_usage(req)
    per_choice: dict[int, int] = {}  # completion tokens so far, for continuous usage

    def so_far(index: int) -> Usage | None:
        return usage(len(job.prompt_token_ids), per_choice.get(index, 0), cached) if every_chunk else None

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
                    yield chunk([ChatChunkChoice(index=d.index, delta=DeltaMessage(role="assistant", content=""))], so_far(d.index))
                per_choice[d.index] = per_choice.get(d.index, 0) + len(d.token_ids)
                if not d.text and d.finish_reason is None and not d.token_ids:
                    continue
                logprobs = s.texts.chat_logprobs(d.logprobs or ()) if req.logprobs else None
                parser = parsers[d.index]
                deltas = _chat_deltas(parser, d.text, d.finish_reason is not None, d.stop_reason)
                finish = d.finish_reason if parser is None else parser.finish_reason(d.finish_reason)
                if not deltas:  # markup the parser holds back: a chunk only to carry logprobs or the finish reason (vLLM sends none)
                    if finish is None and logprobs is None:
                        continue
                    deltas = [DeltaMessage(content="")]
                for k, delta in enumerate(deltas):  # logprobs ride on the first piece, the finish reason on the last
                    last = k == len(deltas) - 1
                    choice = ChatChunkChoice(
                        index=d.index,
                        delta=delta,
                        logprobs=logprobs if k == 0 else None,
                        finish_reason=finish if last else None,
                        stop_reason=d.stop_reason if last else None,
                    )
                    yield chunk([choice], so_far(d.index), ends=choice.finish_reason is not None)
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunk([], usage(len(job.prompt_token_ids), completion_tokens, cached), ends=True)
    except Exception as e:
        yield _stream_error(e)
    finally:
        await updates.aclose()
    yield DONE
