"""An OpenAI request body -> its prompt's token ids -> the chained 64-token keys the router matches on.

The ids are made as the replica's own server makes them (the same tokenizer and chat template, BOS for completion text,
the template's rendering for chat with the request's tools, reasoning effort and template kwargs over the server's
defaults), and the keys with the engine's own chain (serve/cache/hashing.py), in units of the
engine's prefix match unit: a router match is a boundary where the engine can hit. A body the front end cannot read gets
no keys and is routed by load: its replica answers it with the proper 4xx, so the front end need not duplicate the checks.
A request's `cache_salt` is mixed into its keys as the engine mixes it into its own (hashing.request_salt): requests of
one salt are routed together, toward the replica that holds their prefixes, and never by another salt's (or no salt's)
cached prompts, which their replica could not hit anyway.
"""

from __future__ import annotations

import json
import logging

from pydantic import ValidationError

from openk3.api.chat_loading import ChatRenderer
from openk3.api.errors import APIError
from openk3.api.jobs import chat_options
from openk3.api.protocol import ChatCompletionRequest
from openk3.api.structured_request import structured_request
from openk3.api.tool_choice import plan_tools
from openk3.api.user_text import encode_prompt_text
from openk3.serve.cache.hashing import chain_keys, request_salt
from openk3.serve.tokenizer import Tokenizer

log = logging.getLogger("openk3.scale")

ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")


class PromptKeys:
    def __init__(self, tokenizer: Tokenizer, template: ChatRenderer, model_name: str, match_unit: int = 64, default_chat_kwargs: dict | None = None) -> None:
        self.tokenizer = tokenizer
        self.default_chat_kwargs = dict(default_chat_kwargs or {})  # the replicas' --default-chat-template-kwargs
        self.template = template
        self.match_unit = match_unit
        # any fixed salt will do: keys are compared only with keys this router made, never with a replica's own index
        self.salt = f"openk3-router:{model_name}".encode()

    def keys(self, path: str, body: bytes) -> tuple[bytes, ...]:
        return self.keys_of(self.prompt_ids(path, body), self.cache_salt(path, body))

    def keys_of(self, ids: list[int] | None, cache_salt: str | None = None) -> tuple[bytes, ...]:
        return () if ids is None else tuple(chain_keys(request_salt(self.salt, cache_salt), ids, self.match_unit))

    def cache_salt(self, path: str, body: bytes) -> str | None:
        """The body's cache_salt (None without one, or for a body that is not a routed request)."""
        data = self._request(path, body)
        salt = None if data is None else data.get("cache_salt")
        return salt if isinstance(salt, str) and salt else None

    def prompt_ids(self, path: str, body: bytes) -> list[int] | None:
        """The ids to route by: the first prompt of a completion, a chat's prompt as the replica renders it."""
        data = self._request(path, body)
        if data is None:
            return None
        try:
            return self._chat_ids(data) if path == "/v1/chat/completions" else self._completion_ids(data)
        except (ValueError, ValidationError, TypeError, APIError) as e:
            log.debug("no routing keys for %s: %s", path, e)
            return None

    def handoff_ids(self, path: str, body: bytes, routed: list[int] | None) -> list[int] | None:
        """The prompt a prefill replica may compute for the request: `exact_ids`, but None for a salted request (a salted
        request looks only under its salt, and a prefill replica's record is keyed by none)."""
        data = self._request(path, body) if routed is not None else None
        if data is None or data.get("cache_salt") is not None:
            return None
        return self.exact_ids(path, body, routed)

    def exact_ids(self, path: str, body: bytes, routed: list[int] | None) -> list[int] | None:
        """`routed` (prompt_ids' answer) when it is the request's whole prompt, as the replica's server will tokenise it
        (what a prefill replica computes, and what a pulled prefix is checked against); None for several prompts, or a chat
        whose reply the server starts inside the prompt (a named or required tool call, or structured output:
        api/tool_choice.py writes the call's or the reply's opening after the rendered prompt), or one with images (their
        tokens are keyed by the image, which a prefix record is not). A wrong guess costs only the hand-off or the pull: the
        replica's lookup misses, or the pulled record is refused, and it computes the prompt itself."""
        data = self._request(path, body) if routed is not None else None
        if data is None:
            return None
        if path == "/v1/chat/completions":
            try:
                req = ChatCompletionRequest.model_validate(data)
                forced = req.tools and req.tool_choice not in (None, "auto", "none")
                return None if forced or structured_request(req) is not None or _has_images(data) else routed
            except (ValidationError, APIError):
                return None
        prompt = data.get("prompt")
        several = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) and len(prompt) > 1
        return None if several else routed

    def _request(self, path: str, body: bytes) -> dict | None:
        if path not in ROUTED_PATHS:
            return None
        try:
            data = json.loads(body)
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            log.debug("no routing keys for %s: %s", path, e)
            return None
        return data if isinstance(data, dict) else None

    def _completion_ids(self, data: dict) -> list[int] | None:
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # several prompts: route by the first, they go to one replica together
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        return None

    def _chat_ids(self, data: dict) -> list[int] | None:
        req = ChatCompletionRequest.model_validate(data)
        if not req.messages:
            return None
        tok = self.tokenizer
        special = {}
        for name, token_id in (("bos_token", tok.bos_token_id), ("eos_token", tok.eos_token_id)):
            special[name] = "" if token_id is None else tok.decode([token_id], skip_special_tokens=False)
        tools = plan_tools(req, self.template.format, self.template.uses_tools).template_tools()
        kwargs = {**self.default_chat_kwargs, **(req.chat_template_kwargs or {})}
        prompt = self.template.render_prompt(req.messages, req.add_generation_prompt, special, kwargs, tools, tok.special_token_strings, chat_options(req))
        return encode_prompt_text(tok, prompt)


def _has_images(data: dict) -> bool:
    messages = data.get("messages")
    parts = [p for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list) for p in m["content"]] if isinstance(messages, list) else []
    return any(isinstance(p, dict) and p.get("type") in ("image_url", "input_image") for p in parts)
