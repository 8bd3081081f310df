"""vLLM's request fields that shape which tokens come next or which prompt tokens are read -- `logit_bias`,
`allowed_token_ids`, `bad_words`, `truncate_prompt_tokens` -- checked against the served vocabulary and turned into
SamplingParams' token rules (serve/token_rules.py); each bad value is a 400 naming its field."""

from __future__ import annotations

from typing import Any

from openk3.api.errors import APIError
from openk3.api.protocol import _SamplingFields
from openk3.serve.tokenizer import Tokenizer


def _token_id(text: str, vocab_size: int) -> int:
    if not text.isdigit() or int(text) >= vocab_size:
        raise APIError(400, f"logit_bias key {text!r} is not a token id in 0..{vocab_size - 1}", param="logit_bias", code="invalid_value")
    return int(text)


def token_rules(req: _SamplingFields, tokenizer: Tokenizer, vocab_size: int) -> dict[str, Any]:
    """SamplingParams' logit_bias, allowed_token_ids and bad_words_token_ids for this request."""
    out: dict[str, Any] = {}
    if req.logit_bias:
        bias = [(_token_id(k, vocab_size), v) for k, v in req.logit_bias.items()]
        if any(not -100 <= v <= 100 for _, v in bias):
            raise APIError(400, "logit_bias values must lie in [-100, 100]", param="logit_bias", code="invalid_value")
        out["logit_bias"] = tuple(bias)
    if req.allowed_token_ids is not None:
        if not req.allowed_token_ids or max(req.allowed_token_ids) >= vocab_size:
            raise APIError(400, f"allowed_token_ids must be a non-empty list of ids in 0..{vocab_size - 1}", param="allowed_token_ids", code="invalid_value")
        out["allowed_token_ids"] = tuple(req.allowed_token_ids)
    if req.bad_words:
        words: list[tuple[int, ...]] = []
        for word in req.bad_words:
            # as vLLM: the word as written and after a space (a word mid-sentence is usually tokenised with its space)
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(tokenizer.encode(text, add_special_tokens=False))
                if not ids:
                    raise APIError(400, f"bad_words entry {word!r} has no tokens", param="bad_words", code="invalid_value")
                if ids not in words:
                    words.append(ids)
        out["bad_words_token_ids"] = tuple(words)
    return out


def truncate_prompt(ids: list[int], req: _SamplingFields) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last k prompt tokens (the end of a prompt is what a reply continues)."""
    k = req.truncate_prompt_tokens
    return ids if k is None else ids[-k:]
