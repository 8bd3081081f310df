"""From a validated request to engine requests and back: sampling parameters, context checks, merged update streams, logprobs.

Everything a client can get wrong is checked here, before the first byte of a response, so that a streaming request still
fails with a plain 4xx: prompt token ids, the context length (prompt + requested completion against max_model_len), and the
sampling fields (SamplingParams validates; its ValueError names the field), and structured output: `structured_request`
reads the one field that asks for it (response_format, structured_outputs or a guided_* field) and `compile_structured`
compiles it (on a worker thread, cached per spec), a spec the grammar engine refuses being a 400 naming that field.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass

from openk3.api.errors import APIError, from_value_error
from openk3.api.protocol import ChatCompletionRequest, _SamplingFields
from openk3.api.responses import ChatLogprobs, CompletionLogprobs, PromptTokensDetails, TokenLogprob, TopLogprob, Usage
from openk3.serve.frontend import AsyncEngine, RequestStream
from openk3.serve.output import OutputKind, RequestOutput
from openk3.serve.request import TokenLogprobs
from openk3.serve.request_ids import sample_id
from openk3.serve.sampling import SamplingParams
from openk3.serve.structured.compiler import GrammarCompiler, GrammarError
from openk3.serve.structured.spec import Grammar, StructuredOutputs
from openk3.serve.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps to the same value


@dataclass(frozen=True)
class EngineJob:
    prompt_token_ids: list[int]
    params: SamplingParams


def check_prompt(ids: list[int], vocab_size: int, max_model_len: int, max_tokens: int | None, prompt_param: str, tokens_param: str) -> int:
    """Validate one prompt; returns the completion length it will get (max_tokens, or the rest of the context when None)."""
    if not ids:
        raise APIError(400, f"{prompt_param} is empty: expected at least one token", param=prompt_param, code="invalid_value")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"{prompt_param} has token id {bad}: expected ids in 0..{vocab_size - 1}", param=prompt_param, code="invalid_value")
    room = max_model_len - len(ids)
    if room < 1 or (max_tokens is not None and max_tokens > room):
        asked = "none left" if max_tokens is None else f"{max_tokens} for the completion"
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{len(ids) + (max_tokens or 0)} tokens ({len(ids)} in the {prompt_param}, {asked}). "
            f"Please reduce the length of the {prompt_param} or the {tokens_param}.",
            param=prompt_param if room < 1 else tokens_param,
            code="context_length_exceeded",
        )
    return max_tokens if max_tokens is not None else room


@dataclass(frozen=True)
class StructuredRequest:
    param: str  # the request field that asked for it
    spec: StructuredOutputs


GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _spec(param: str, **fields: object) -> StructuredOutputs:
    try:
        return StructuredOutputs(**fields)  # type: ignore[arg-type]
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_value") from e


def structured_request(req: _SamplingFields) -> StructuredRequest | None:
    """The structured output a request asks for, or None; two fields asking for it at once are a 400."""
    rf = req.response_format if isinstance(req, ChatCompletionRequest) else None  # legacy completions have none
    asked = [name for name in ("response_format", "structured_outputs", *GUIDED) if getattr(req, name, None) is not None]
    if rf is not None and rf.type == "text":
        asked.remove("response_format")
    if len(asked) > 1:
        raise APIError(400, f"{' and '.join(asked)} both ask for structured output: send one of them", param=asked[1], code="invalid_value")
    if not asked:
        return None
    param = asked[0]
    if rf is not None and param == "response_format":
        if rf.type == "json_object":
            return StructuredRequest(param, _spec(param, json_object=True))
        if rf.json_schema is None:
            raise APIError(400, "response_format.json_schema is required when type is 'json_schema'", param=param, code="invalid_value")
        schema = rf.json_schema.schema_
        return StructuredRequest(param, _spec(param, json_object=True) if schema is None else _spec(param, json=schema))
    so = req.structured_outputs
    if so is not None:
        whitespace = so.disable_any_whitespace is False
        fields = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar, "json_object": bool(so.json_object)}
        fields["structural_tag"] = so.structural_tag
        return StructuredRequest(param, _spec(param, any_whitespace=whitespace, **fields))
    value = getattr(req, param)
    return StructuredRequest(param, _spec(param, **{param.removeprefix("guided_"): value}))


def compile_structured(compiler: GrammarCompiler, asked: StructuredRequest) -> Grammar:
    """Blocking (milliseconds for ordinary schemas, more for big ones): call it on a worker thread."""
    try:
        return compiler.compile(asked.spec)
    except GrammarError as e:
        raise APIError(400, f"{asked.param} ({e.field}) {e.reason}", param=asked.param, code="invalid_value") from e


def sampling_params(
    req: _SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    extra_stop: Sequence[str] = (),
    extra_stop_ids: Sequence[int] = (),
    skip_special_tokens: bool | None = None,
    grammar: Grammar | None = None,
) -> SamplingParams:
    """The request's sampling fields plus the server's own stops (end of turn, the checkpoint's end tokens unless ignore_eos).
    `skip_special_tokens`, when given, decides over the request's (the chat parsers need the format's markers in the text)."""
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported by this server", param="logit_bias", code="unsupported")
    if req.stream_options is not None and not req.stream:  # OpenAI refuses it too: it would be silently meaningless
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options", code="invalid_value")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    stop += [s for s in extra_stop if s not in stop]
    stop_ids = list(req.stop_token_ids or ())
    if not req.ignore_eos:
        stop_ids += [t for t in extra_stop_ids if t not in stop_ids]
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(stop_ids),
            include_stop_str_in_output=req.include_stop_str_in_output or req.no_stop_trim,  # vLLM's name or SGLang's
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            skip_special_tokens=req.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
            structured_outputs=grammar,
        )
    except ValueError as e:
        raise from_value_error(e) from e


class Updates:
    """(prompt index, output) for every engine request of one HTTP request, as they come; `aclose` aborts those unfinished."""

    def __init__(self, streams: list[RequestStream]) -> None:
        self._streams = streams
        self._queue: asyncio.Queue = asyncio.Queue()
        self._remaining = len(streams)
        self._tasks = [asyncio.ensure_future(self._pump(i, stream)) for i, stream in enumerate(streams)]

    async def _pump(self, i: int, stream: RequestStream) -> None:
        try:
            async for update in stream:
                self._queue.put_nowait((i, update))
        except Exception as e:  # handed to the consumer, which raises it
            self._queue.put_nowait((i, e))

    def __aiter__(self) -> Updates:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._remaining:
            raise StopAsyncIteration
        i, item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        if item.finished:
            self._remaining -= 1
        return i, item

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for stream in self._streams:
            await stream.aclose()


async def open_updates(frontend: AsyncEngine, request_id: str, jobs: list[EngineJob], kind: OutputKind) -> Updates:
    """Add every prompt of one HTTP request to the engine, all or none (a refusal -- bad input, a full queue -- aborts those
    already added), before the first byte of the response: so a refusal is still a plain HTTP error."""
    streams: list[RequestStream] = []
    try:
        for i, job in enumerate(jobs):
            engine_id = request_id if len(jobs) == 1 else sample_id(request_id, i)
            streams.append(await frontend.add(engine_id, job.prompt_token_ids, job.params, kind))
    except BaseException:
        for stream in streams:
            await stream.aclose()
        raise
    return Updates(streams)


async def final_outputs(frontend: AsyncEngine, request_id: str, jobs: list[EngineJob]) -> list[RequestOutput]:
    """Run every prompt of one HTTP request to its end; one whole output per prompt, in prompt order."""
    done: dict[int, RequestOutput] = {}
    updates = await open_updates(frontend, request_id, jobs, OutputKind.FINAL_ONLY)
    try:
        async for i, out in updates:
            done[i] = out
    finally:
        await updates.aclose()
    return [done[i] for i in range(len(jobs))]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def _clamp(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


class TokenTexts:
    """Each token's own text for logprobs (one id decoded alone, specials spelled out), cached per id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def completion_logprobs(self, lps: Sequence[TokenLogprobs], offset: int) -> tuple[CompletionLogprobs, int]:
        out = CompletionLogprobs()
        for lp in lps:
            text = self(lp.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(_clamp(lp.logprob))
            out.top_logprobs.append({self(t): _clamp(v) for t, v in lp.top})
            out.text_offset.append(offset)
            offset += len(text)
        return out, offset

    def chat_logprobs(self, lps: Sequence[TokenLogprobs]) -> ChatLogprobs:
        content = []
        for lp in lps:
            text = self(lp.token_id)
            top = [TopLogprob(token=self(t), logprob=_clamp(v), bytes=list(self(t).encode("utf-8", "replace"))) for t, v in lp.top]
            content.append(TokenLogprob(token=text, logprob=_clamp(lp.logprob), bytes=list(text.encode("utf-8", "replace")), top_logprobs=top))
        return ChatLogprobs(content=content)
