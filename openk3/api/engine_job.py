"""A validated request's prompt and sampling fields -> an engine job (prompt ids and SamplingParams).

Everything a client can get wrong is checked here, before the first byte of a response, so that a streaming request still
fails with a plain 4xx: prompt token ids, the context length (prompt + requested completion against max_model_len), and the
sampling fields (SamplingParams validates; its ValueError names the field).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from openk3.api.errors import APIError, from_value_error
from openk3.api.protocol import _SamplingFields
from openk3.serve.media_prompt import ImageSpan
from openk3.serve.prompt_check import PromptError
from openk3.serve.prompt_check import check_prompt as serve_check_prompt
from openk3.serve.sampling import SamplingParams
from openk3.serve.structured.spec import Grammar


@dataclass(frozen=True)
class EngineJob:
    prompt_token_ids: list[int]
    params: SamplingParams
    images: tuple[ImageSpan, ...] = ()  # the prompt's images and their media tokens' positions (api/images.py)


def check_prompt(ids: list[int], vocab_size: int, max_model_len: int, max_tokens: int | None, prompt_param: str, tokens_param: str) -> int:
    """Validate one prompt by the engine's rule (serve/prompt_check.py), named as this request names it, and the completion
    it asks for; returns the completion length it will get (max_tokens, or the rest of the context when None)."""
    try:
        serve_check_prompt(ids, vocab_size, max_model_len)
    except PromptError as e:
        raise APIError(400, e.message(prompt_param), param=prompt_param, code=e.code) from None
    room = max_model_len - len(ids)
    if max_tokens is not None and max_tokens > room:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{len(ids) + max_tokens} tokens ({len(ids)} in the {prompt_param}, {max_tokens} for the completion). "
            f"Please reduce the length of the {prompt_param} or the {tokens_param}.",
            param=tokens_param,
            code="context_length_exceeded",
        )
    return max_tokens if max_tokens is not None else room


def sampling_params(
    req: _SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    extra_stop: Sequence[str] = (),
    extra_stop_ids: Sequence[int] = (),
    skip_special_tokens: bool | None = None,
    grammar: Grammar | None = None,
    prompt_logprobs: int | None = None,
    token_rules: dict[str, Any] | None = None,
    defaults: Mapping[str, Any] | None = None,
    return_routing: bool = False,
) -> SamplingParams:
    """The request's sampling fields plus the server's own stops (end of turn, the checkpoint's end tokens unless ignore_eos).
    `skip_special_tokens`, when given, decides over the request's (the chat parsers need the format's markers in the text);
    `prompt_logprobs`, when given, over the request's (completions' echo + logprobs scores the prompt too); `defaults`: the
    checkpoint's generation_config.json values, for each sampling field the request does not set."""
    if req.stream_options is not None and not req.stream:  # OpenAI refuses it too: it would be silently meaningless
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options", code="invalid_value")
    if req.prompt_logprobs is not None and req.stream:  # as vLLM: they have no place in a stream's chunks
        raise APIError(400, "prompt_logprobs is not available when stream is true", param="prompt_logprobs", code="invalid_value")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    stop += [s for s in extra_stop if s not in stop]
    stop_ids = list(req.stop_token_ids or ())
    if not req.ignore_eos:
        stop_ids += [t for t in extra_stop_ids if t not in stop_ids]
    given = req.model_fields_set
    d = {k: v for k, v in (defaults or {}).items() if k not in given and k != "max_tokens"}
    try:
        return SamplingParams(
            n=req.n,
            temperature=d.get("temperature", 1.0) if req.temperature is None else req.temperature,
            top_p=d.get("top_p", 1.0) if req.top_p is None else req.top_p,
            top_k=d.get("top_k") if req.top_k is None else req.top_k,
            min_p=d.get("min_p", req.min_p),
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(stop_ids),
            include_stop_str_in_output=req.include_stop_str_in_output or req.no_stop_trim,  # vLLM's name or SGLang's
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            return_routing=return_routing,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=d.get("repetition_penalty", req.repetition_penalty),
            skip_special_tokens=req.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
            structured_outputs=grammar,
            priority=req.priority,
            client=req.user or req.safety_identifier or None,  # the fair policy's client (docs/serving.md)
            cache_salt=req.cache_salt,
            **(token_rules or {}),
        )
    except ValueError as e:
        raise from_value_error(e) from e
