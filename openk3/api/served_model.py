"""ServedModel: what the handlers need of the running server (api/jobs.py builds a request's engine jobs from it,
api/replies.py its answers); ModelIdentity: which model the server answers as, set once in ServerConfig and shared."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from openk3.api.chat import ChatOptions
from openk3.api.chat_format import CALL_MARKUP
from openk3.api.chat_loading import ChatRenderer
from openk3.api.errors import APIError
from openk3.api.images import MediaSupport
from openk3.api.limits import RequestLimits
from openk3.api.prompt_text import PromptEncoder
from openk3.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from openk3.api.structured_request import compile_structured, structured_request
from openk3.api.token_texts import TokenTexts
from openk3.api.tool_choice import Spelling
from openk3.api.user_text import PromptText
from openk3.serve.async_engine import AsyncEngine
from openk3.serve.structured.compiler import GrammarCompiler
from openk3.serve.structured.spec import Grammar
from openk3.serve.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelIdentity:
    """Which model the server answers as: the name clients send in `model`, its root (the preset or the folder it was
    loaded from, for /v1/models and /get_model_info), and the checkpoint's end tokens (generation_config.json), which
    every request stops at, and its sampling defaults (serve/generation_config.py)."""

    name: str
    root: str
    stop_token_ids: tuple[int, ...] = ()
    sampling_defaults: dict = field(default_factory=dict)  # generation_config.json's, for fields a request leaves unset


@dataclass(frozen=True)
class ServedModel:
    """The model being served, as the handlers see it: the engine's front end, the tokenizer and chat template, which
    model it is, its lengths and the stops every request gets; fixed for the server's lifetime."""

    frontend: AsyncEngine
    tokenizer: Tokenizer
    chat_template: ChatRenderer
    model: ModelIdentity
    max_model_len: int
    vocab_size: int
    texts: TokenTexts
    encoder: PromptEncoder  # text -> token ids on its own threads, after the size check
    limits: RequestLimits = field(default_factory=RequestLimits)
    chat_stop: tuple[str, ...] = ()  # the chat template's end of turn, when it is text
    chat_stop_token_ids: tuple[int, ...] = ()  # ... or when it is one special token
    default_chat_kwargs: dict = field(default_factory=dict)  # --default-chat-template-kwargs: a request's own keys win
    media: MediaSupport | None = None  # image input (api/images.py); None: image parts are a 400

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """Structured-output grammars for this tokenizer, compiled once per spec (built on first use, on a worker thread)."""
        # the model's vocabulary (the logits width), which may run past the tokenizer's ids (`vocab_size` is the smaller)
        return GrammarCompiler(self.tokenizer, self.frontend.engine.model_config.vocab_size)

    @functools.cached_property
    def call_grammars(self) -> GrammarCompiler:
        """Tool-call grammars: as `grammars`, except that the Kimi formats' marker special tokens may be written as the one
        token each is (chat_format.CALL_MARKUP), so a forced call costs the tokens the model would spend on it."""
        return GrammarCompiler(self.tokenizer, self.frontend.engine.model_config.vocab_size, markup=self.call_markup)

    @functools.cached_property
    def call_markup(self) -> frozenset[str]:
        """The Kimi formats' call markers this tokenizer has as special tokens."""
        return frozenset().union(*CALL_MARKUP.values()) & self.tokenizer.special_token_strings

    @functools.cached_property
    def call_spelling(self) -> Spelling:
        """How an enforced call writes the format's text with this tokenizer (tool_choice.Spelling): markers as their one
        token, the text between them as the prompt encoder's ids for it."""
        tok = self.tokenizer
        markers = {m: ids[0] for m in self.call_markup if len(ids := tok.encode_with_plain(m, ())) == 1}
        return Spelling(markers, lambda text: tok.encode_with_plain(text, ((0, len(text)),)))

    async def grammar(self, req: CompletionRequest | ChatCompletionRequest) -> Grammar | None:
        asked = structured_request(req)
        return None if asked is None else await self.encoder.run(lambda: compile_structured(self.grammars, asked))

    def special_tokens(self) -> dict[str, str]:
        tok, out = self.tokenizer, {}
        for name, token_id in (("bos_token", tok.bos_token_id), ("eos_token", tok.eos_token_id)):
            out[name] = "" if token_id is None else tok.decode([token_id], skip_special_tokens=False)
        return out

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        kwargs: dict | None = None,
        tools: list[dict] | None = None,
        options: ChatOptions | None = None,
    ) -> PromptText:
        """The chat prompt, with the spans of request text that must not become special tokens (api/user_text.py)."""
        if not messages:
            raise APIError(400, "messages is empty: expected at least one message", param="messages", code="invalid_value")
        kwargs = {**self.default_chat_kwargs, **(kwargs or {})}
        try:
            self.chat_template.check_kwargs(kwargs)
        except ValueError as e:
            raise APIError(400, str(e), param="chat_template_kwargs", code="unsupported") from e
        if options is not None and options.reasoning_effort is not None:
            try:
                self.chat_template.check_effort(options.reasoning_effort, kwargs)
            except ValueError as e:
                raise APIError(400, str(e), param="reasoning_effort", code="unsupported") from e
        try:
            markers = self.tokenizer.special_token_strings
            return self.chat_template.render_prompt(messages, add_generation_prompt, self.special_tokens(), kwargs, tools, markers, options)
        except ValueError as e:
            raise APIError(400, str(e), param="messages", code="invalid_value") from e
