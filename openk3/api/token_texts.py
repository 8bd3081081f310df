"""Each token's own text, for logprobs in the completions and chat formats (OpenAI's shapes; JSON has no -inf)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from openk3.api.responses import ChatLogprobs, CompletionLogprobs, PromptLogprob, PromptLogprobs, TokenLogprob, TopLogprob
from openk3.serve.request import TokenLogprobs
from openk3.serve.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps to the same value


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

    def echo_logprobs(self, prompt_ids: Sequence[int], scored: Sequence[TokenLogprobs]) -> tuple[CompletionLogprobs, int]:
        """The prompt's part of echo + logprobs, as vLLM returns it: the first token with None, every other token's top
        alternatives with the token itself among them (lm-eval reads "greedy" off that)."""
        first = self(prompt_ids[0])
        out = CompletionLogprobs(tokens=[first], token_logprobs=[None], top_logprobs=[None], text_offset=[0])
        offset = len(first)
        for lp in scored:
            text = self(lp.token_id)
            top = {self(t): _clamp(v) for t, v in lp.top}
            top[text] = _clamp(lp.logprob)
            out.tokens.append(text)
            out.token_logprobs.append(_clamp(lp.logprob))
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(text)
        return out, offset

    def prompt_logprobs(self, scored: Sequence[TokenLogprobs]) -> PromptLogprobs:
        """vLLM's `prompt_logprobs`: per prompt token {token id: {logprob, rank, decoded_token}}, the token itself and its
        top alternatives (ranked 1..k); None for the first token."""
        out: PromptLogprobs = [None]
        for lp in scored:
            entry = {str(lp.token_id): PromptLogprob(logprob=_clamp(lp.logprob), rank=lp.rank, decoded_token=self(lp.token_id))}
            for rank, (t, v) in enumerate(lp.top, 1):
                entry.setdefault(str(t), PromptLogprob(logprob=_clamp(v), rank=rank, decoded_token=self(t)))
            out.append(entry)
        return out

    def chat_logprobs(self, lps: Sequence[TokenLogprobs]) -> ChatLogprobs:
        content = []
        for lp in lps:
            text = self(lp.token_id)
            top = [TopLogprob(token=self(t), logprob=_clamp(v), bytes=list(self(t).encode("utf-8", "replace"))) for t, v in lp.top]
            content.append(TokenLogprob(token=text, logprob=_clamp(lp.logprob), bytes=list(text.encode("utf-8", "replace")), top_logprobs=top))
        return ChatLogprobs(content=content)
