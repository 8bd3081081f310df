"""`/v1/completions` and `/v1/chat/completions`, first half: a validated request -> the engine jobs that answer it.

`completion_jobs` and `chat_job` check a request against the served model (api/served_model.py) and build its jobs
(prompt ids, sampling parameters, grammar). A chat request in a Kimi format also gets what its replies are parsed with
(`ChatJob`: the tool plan, the block the prompt left open, a forced call's prefix). The second half, engine outputs ->
JSON responses and SSE streams, is api/replies.py.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from openk3.api.agent_output import ChoiceParser
from openk3.api.chat import ChatOptions
from openk3.api.chat_format import K3_MARKERS, ChatFormat, PromptEnd, forced_call_prefix, prompt_end
from openk3.api.engine_job import EngineJob, check_prompt, sampling_params
from openk3.api.errors import APIError
from openk3.api.images import chat_image_refs, check_count, load_images, no_images, place, remote_refs
from openk3.api.media_fetch import fetch_all
from openk3.api.protocol import ChatCompletionRequest, CompletionRequest
from openk3.api.served_model import ServedModel
from openk3.api.structured_request import StructuredRequest, compile_structured
from openk3.api.token_fields import token_rules, truncate_prompt
from openk3.api.tool_choice import ToolPlan, plan_tools, required_call_prefix, structured_reply_prefix
from openk3.api.user_text import PromptText
from openk3.serve.media_prompt import ImageSpan
from openk3.serve.vision_processor import ImageInput

MAX_CHOICES = 256  # prompts x n in one request


@dataclass(frozen=True)
class ChatJob:
    """A chat request's engine job and what its replies are parsed with (nothing without a Kimi chat format)."""

    job: EngineJob
    plan: ToolPlan
    end: PromptEnd | None = None  # the block the prompt left open
    forced_prefix: str = ""  # written into the prompt to force a call; the parser reads it as the reply's start
    hidden: frozenset[str] = frozenset()  # special tokens the reply must not show as text (agent_output.HiddenTokens)

    def parser(self) -> ChoiceParser | None:
        return None if self.end is None else ChoiceParser(self.plan, self.end, self.forced_prefix, self.hidden)


def default_max_tokens(s: ServedModel, ids: list[int]) -> int | None:
    """generation_config.json's max_new_tokens, cut to the room the prompt leaves (as vLLM does), for a request that sets none."""
    default = s.model.sampling_defaults.get("max_tokens")
    return None if default is None else max(1, min(int(default), s.max_model_len - len(ids)))


def check_priority(s: ServedModel, req: CompletionRequest | ChatCompletionRequest) -> None:
    """vLLM's priority needs a policy that orders by it; under fcfs (the default) anything but 0 is refused, as vLLM does,
    rather than served out of the order it asked for. (cache_salt needs no check: the prefix cache keys by it.)"""
    policy = s.frontend.engine.config.scheduling_policy
    if req.priority != 0 and policy == "fcfs":
        raise APIError(
            400,
            f"priority={req.priority} needs priority scheduling: this server runs --scheduling-policy fcfs; start it with "
            "--scheduling-policy priority (or fair) to serve requests by priority",
            param="priority",
            code="unsupported",
        )


def verbosity_kwargs(req: ChatCompletionRequest, template: Any) -> dict[str, Any] | None:
    """chat_template_kwargs plus OpenAI's `verbosity`, handed to a Jinja template that reads it (as vLLM does); a template
    that does not read it (K3's encoding among them) makes it a 400 rather than a field quietly dropped. reasoning_effort
    goes with the ChatOptions (chat_options below), which both renderers read."""
    kwargs = dict(req.chat_template_kwargs or {})
    if req.verbosity is not None:
        if "verbosity" not in getattr(template, "variables", frozenset()):
            raise APIError(
                400,
                f"verbosity={req.verbosity!r} is not supported: the chat template ({template.origin}) does not read verbosity",
                param="verbosity",
                code="unsupported",
            )
        kwargs["verbosity"] = req.verbosity
    return kwargs or None


async def completion_jobs(s: ServedModel, req: CompletionRequest) -> tuple[list[EngineJob], list[str]]:
    s.limits.check(req)
    if req.suffix:
        raise APIError(400, "suffix is not supported by this server", param="suffix", code="unsupported")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, f"best_of={req.best_of} is not supported: only best_of equal to n ({req.n})", param="best_of", code="unsupported")
    for name in ("return_token_ids", "return_routed_experts"):
        if getattr(req, name) and req.stream:  # whole-sequence fields: they go with the final response
            raise APIError(400, f"{name} is not available when stream is true", param=name, code="invalid_value")
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens=0 is only allowed with echo (to score the prompt without generating)", param="max_tokens", code="invalid_value")
    p = req.prompt
    prompts: list[str | list[int]] = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)  # type: ignore[arg-type]
    if not prompts:
        raise APIError(400, "prompt is empty: expected a string, a list of strings or token ids", param="prompt", code="invalid_value")
    if len(prompts) * req.n > MAX_CHOICES:
        raise APIError(400, f"{len(prompts)} prompts x n={req.n} is more than {MAX_CHOICES} choices", param="n", code="invalid_value")
    grammar = await s.grammar(req)
    # echo + logprobs returns the prompt's logprobs too (vLLM): scored with as many alternatives as either field asks
    scored = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        scored = max(req.logprobs, scored or 0)
    # max_tokens=0 (echo only) generates one token, which the reply leaves out: the prompt's last row is computed anyway
    asked = 1 if req.max_tokens == 0 else req.max_tokens
    check_priority(s, req)
    rules = await s.encoder.run(lambda: token_rules(req, s.tokenizer, s.vocab_size))
    jobs, texts = [], []
    for prompt in prompts:
        ids = await s.encoder.encode(prompt, "prompt", add_special_tokens=True) if isinstance(prompt, str) else list(prompt)  # vLLM: BOS for text
        whole = len(ids)
        ids = truncate_prompt(ids, req)
        wanted = asked if asked is not None else default_max_tokens(s, ids)  # generation_config.json's max_tokens, if any
        max_tokens = check_prompt(ids, s.vocab_size, s.max_model_len, wanted, "prompt", "max_tokens")
        params = sampling_params(
            req,
            max_tokens,
            req.logprobs,
            extra_stop_ids=s.model.stop_token_ids,
            grammar=grammar,
            prompt_logprobs=scored,
            token_rules=rules,
            defaults=s.model.sampling_defaults,
            return_routing=req.return_routed_experts,
        )
        jobs.append(EngineJob(ids, params))
        if isinstance(prompt, str) and len(ids) == whole:
            texts.append(prompt)
        else:  # token ids, or a prompt truncate_prompt_tokens cut
            texts.append(await s.encoder.run(functools.partial(s.tokenizer.decode, ids)))
    return jobs, texts


def chat_options(req: ChatCompletionRequest, images: Sequence[ImageInput] = ()) -> ChatOptions:
    """The request fields the prompt depends on: K3's encoding writes a tool-choice message for `required` / `none` (when
    tools were sent) and a response-format message for JSON mode; the grammar enforces both all the same. And the size of
    each image, which K3's image marker states."""
    choice = req.tool_choice if isinstance(req.tool_choice, str) and req.tools else None
    response_format = None if req.response_format is None else req.response_format.model_dump(by_alias=True, exclude_none=True)
    return ChatOptions(req.reasoning_effort, choice, response_format, tuple((im.width, im.height) for im in images))


async def chat_images(s: ServedModel, req: ChatCompletionRequest) -> list[ImageInput]:
    """The request's images, decoded and processed on the tokenizer threads (api/images.py); a 400 for any image part when
    the server takes none."""
    media = s.media
    if media is None:
        no_images(req.messages)
        return []
    refs = chat_image_refs(req.messages)
    if not refs:
        return []
    if req.truncate_prompt_tokens is not None:
        why = "truncate_prompt_tokens with images is not supported: a cut could split an image's tokens"
        raise APIError(400, why, param="truncate_prompt_tokens", code="unsupported")
    check_count(refs, s.limits)  # before fetching anything
    remote = remote_refs(refs, media.fetch)
    bodies = await fetch_all([(r.url, r.param + ".url") for r in remote.values()], media.fetch, s.limits.max_image_bytes)
    fetched = dict(zip(remote, bodies, strict=True))
    return await s.encoder.run(lambda: load_images(refs, media, s.limits, fetched))


async def chat_job(s: ServedModel, req: ChatCompletionRequest) -> ChatJob:
    s.limits.check(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs", code="invalid_value")
    check_priority(s, req)
    template = s.chat_template
    plan = plan_tools(req, template.format, template.uses_tools)
    tools = plan.template_tools()
    images = await chat_images(s, req)
    options = chat_options(req, images)
    kwargs = verbosity_kwargs(req, s.chat_template)
    prompt = await s.encoder.run(lambda: s.render_chat(req.messages, req.add_generation_prompt, kwargs, tools, options))
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
        call = plan.call_grammar(calls_before, s.call_spelling)
        if call is not None:
            grammar = await s.encoder.run(lambda: compile_structured(s.call_grammars, StructuredRequest("tools", call)))
    cuts = prompt.cuts + (len(prompt.text),) if prompt.cuts and forced else prompt.cuts  # the forced prefix: one piece more
    ids = truncate_prompt(await s.encoder.encode_prompt(PromptText(prompt.text + forced, prompt.plain, cuts), "messages"), req)
    spans: tuple[ImageSpan, ...] = ()
    if images:
        assert s.media is not None
        ids, spans = place(ids, images, s.media)
    rules = await s.encoder.run(lambda: token_rules(req, s.tokenizer, s.vocab_size))
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    asked = asked if asked is not None else default_max_tokens(s, ids)
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = check_prompt(ids, s.vocab_size, s.max_model_len, asked, "messages", param)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    stop_ids = s.model.stop_token_ids + s.chat_stop_token_ids
    call_stop = plan.call_stop()
    stops = s.chat_stop + ((call_stop,) if call_stop is not None else ())
    # the parsers read the format's markers, which a Kimi tokenizer has as special tokens: keep them in the text
    skip = None if plan.fmt is None else False
    params = sampling_params(
        req,
        max_tokens,
        logprobs,
        extra_stop=stops,
        extra_stop_ids=stop_ids,
        skip_special_tokens=skip,
        grammar=grammar,
        token_rules=rules,
        defaults=s.model.sampling_defaults,
    )
    # K3 replies are decoded with special tokens kept for the parsers: every one but the format's markers is dropped
    hidden = s.tokenizer.special_token_strings - K3_MARKERS if plan.fmt is ChatFormat.KIMI_K3 else frozenset()
    return ChatJob(EngineJob(ids, params, spans), plan, end, forced, hidden)
