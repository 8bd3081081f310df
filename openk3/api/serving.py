"""`/v1/completions` and `/v1/chat/completions`, first half: a validated request -> the engine jobs that answer it.

`Served` is what the handlers need of the running server; `completion_jobs` and `chat_job` check a request against it and
build its jobs (prompt ids, sampling parameters, grammar). A chat request in a Kimi format also gets what its replies are
parsed with (`ChatJob`: the tool plan, the block the prompt left open, a forced call's prefix). The second half, engine
outputs -> JSON responses and SSE streams, is api/replies.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from openk3.api.agent_output import ChoiceParser
from openk3.api.chat import ChatTemplate
from openk3.api.chat_format import PromptEnd, forced_call_prefix, prompt_end
from openk3.api.errors import APIError
from openk3.api.generation import (
    EngineJob,
    StructuredRequest,
    TokenTexts,
    check_prompt,
    compile_structured,
    sampling_params,
    structured_request,
)
from openk3.api.limits import RequestLimits
from openk3.api.prompt_text import PromptEncoder
from openk3.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from openk3.api.tool_choice import ToolPlan, plan_tools, required_call_prefix, structured_reply_prefix
from openk3.api.user_text import PromptText
from openk3.serve.frontend import AsyncEngine
from openk3.serve.structured.compiler import GrammarCompiler
from openk3.serve.structured.spec import Grammar
from openk3.serve.tokenizer import Tokenizer

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

    def render_chat(
        self, messages: list[ChatMessage], add_generation_prompt: bool = True, kwargs: dict | None = None, tools: list[dict] | None = None
    ) -> PromptText:
        """The chat prompt, with the spans of request text that must not become special tokens (api/user_text.py)."""
        if not messages:
            raise APIError(400, "messages is empty: expected at least one message", param="messages", code="invalid_value")
        try:
            self.chat_template.check_kwargs(kwargs)
        except ValueError as e:
            raise APIError(400, str(e), param="chat_template_kwargs", code="unsupported") from e
        try:
            markers = self.tokenizer.special_token_strings
            return self.chat_template.render_prompt(messages, add_generation_prompt, self.special_tokens(), kwargs, tools, markers)
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
    prompt = await s.encoder.run(lambda: s.render_chat(req.messages, req.add_generation_prompt, req.chat_template_kwargs, tools))
    end = None if plan.fmt is None else prompt_end(plan.fmt, prompt.text)
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
    ids = await s.encoder.encode_prompt(PromptText(prompt.text + forced, prompt.plain), "messages")
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
