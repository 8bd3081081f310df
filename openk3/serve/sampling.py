"""SamplingParams: what a caller may ask of one generation, with vLLM's names, defaults and meanings.

Validated once here so that the scheduler, sampler and engine can trust every field; a bad value raises ValueError naming the field,
the value and the allowed range (the API layer turns it into an HTTP 400).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from openk3.checks import check_int, fail
from openk3.serve.structured.spec import Grammar

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows, and vLLM draws the same line.
GREEDY_TEMPERATURE = 1e-5


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None  # None (or vLLM's 0 / -1) keeps every token
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until the context length runs out
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (the sampled token's is always included)
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token, scored in the prefill (serve/prompt_logprobs.py)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    # the grammar the output must match, compiled for the model's vocabulary (serve/structured: GrammarCompiler.compile)
    structured_outputs: Grammar | None = None
    # token rules (serve/token_rules.py): (token id, bias) pairs, the only tokens allowed, token sequences never written
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # the top-k experts of every MoE layer for every token run, returned with the completion (serve/routing.py)
    return_routing: bool = False
    # how the engine schedules and caches the request, not how it samples: they ride here because SamplingParams is what
    # reaches every engine and rank unchanged (as return_routing does)
    priority: int = 0  # lower is served first under the priority and fair policies (serve/policy.py); fcfs needs 0
    client: str | None = None  # who sent it, shared fairly with other clients under the fair policy (None: the anonymous one)
    cache_salt: str | None = None  # only requests with the same salt share cached prefixes (serve/cache/hashing.py)

    def __post_init__(self) -> None:
        # Accept the list/str spellings callers use and store immutable tuples.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k is not None and _is_int(self.top_k) and self.top_k in (0, -1):
            object.__setattr__(self, "top_k", None)

        check_int("SamplingParams", "n", self.n, low=1)
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            fail("SamplingParams", "temperature", self.temperature, "a float >= 0 (0 means greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            fail("SamplingParams", "top_p", self.top_p, "a float in (0, 1]")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            fail("SamplingParams", "top_k", self.top_k, "None, 0 or -1 (disabled) or an integer >= 1")
        if not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            fail("SamplingParams", "min_p", self.min_p, "a float in [0, 1]")
        check_int("SamplingParams", "seed", self.seed, optional=True)
        check_int("SamplingParams", "max_tokens", self.max_tokens, low=1, optional=True)
        check_int("SamplingParams", "min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("SamplingParams", "min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("SamplingParams", "stop", self.stop, "non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            fail("SamplingParams", "stop_token_ids", self.stop_token_ids, "non-negative integer token ids")
        check_int("SamplingParams", "logprobs", self.logprobs, low=0, optional=True)
        check_int("SamplingParams", "prompt_logprobs", self.prompt_logprobs, low=0, optional=True)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not -2 <= value <= 2:
                fail("SamplingParams", name, value, "a float in [-2, 2]")
        if not isinstance(self.repetition_penalty, (int, float)) or not self.repetition_penalty > 0:
            fail("SamplingParams", "repetition_penalty", self.repetition_penalty, "a float > 0 (1 disables it)")
        check_int("SamplingParams", "priority", self.priority, low=-(2**63), high=2**63 - 1)
        for name in ("client", "cache_salt"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                fail("SamplingParams", name, value, "None or a non-empty string")
        self._check_token_rules()
        if self.structured_outputs is not None:
            self._check_structured()

    def _check_token_rules(self) -> None:
        object.__setattr__(self, "logit_bias", tuple((t, float(b)) for t, b in self.logit_bias))
        if any(not _is_int(t) or t < 0 or not -100 <= b <= 100 for t, b in self.logit_bias):
            fail("SamplingParams", "logit_bias", self.logit_bias, "(token id >= 0, bias in [-100, 100]) pairs")
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
            if not self.allowed_token_ids or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids):
                fail("SamplingParams", "allowed_token_ids", self.allowed_token_ids, "None or a non-empty list of token ids")
        object.__setattr__(self, "bad_words_token_ids", tuple(tuple(w) for w in self.bad_words_token_ids))
        if any(not w or any(not _is_int(t) or t < 0 for t in w) for w in self.bad_words_token_ids):
            fail("SamplingParams", "bad_words_token_ids", self.bad_words_token_ids, "non-empty token id sequences")

    def _check_structured(self) -> None:
        if not isinstance(self.structured_outputs, Grammar):
            fail("SamplingParams", "structured_outputs", self.structured_outputs, "None or a Grammar (GrammarCompiler.compile(StructuredOutputs(...)))")
        # the grammar decides where the reply may end: a floor on its length would leave no token allowed
        if self.min_tokens:
            fail("SamplingParams", "min_tokens", self.min_tokens, "0 with structured_outputs (the grammar decides where the output ends)")
        if self.ignore_eos and not self.stop_token_ids:
            fail("SamplingParams", "ignore_eos", self.ignore_eos, "False with structured_outputs unless stop_token_ids end the output")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    def for_child(self, index: int) -> SamplingParams:
        """The params of the index-th of n samples: one sample each, and distinct seeds so seeded samples differ (vLLM: seed + index)."""
        return self.replace(n=1, seed=None if self.seed is None else self.seed + index)
