"""Policies an episode samples replies from: the engine (LLMPolicy, token ids in and out, with logprobs and optionally
routing) and a scripted one (ScriptedPolicy: fixed replies, for tests that need to know what the agent does)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from openk3.llm import LLM
from openk3.serve.routing import RoutingTrace
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import Tokenizer


class Context(NamedTuple):
    branch: int  # which sample of the group
    token_ids: Sequence[int]  # everything so far: prompt, replies, observations


@dataclass(frozen=True)
class Reply:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # the sampling logprob of each token
    routing: RoutingTrace | None = None  # the call's routing: the whole context but the reply's last token
    weight_version: int | None = None  # the engine's weights it was sampled with, where the policy knows (AsyncEnginePolicy)
    cached_tokens: int = 0  # of the context, the tokens the engine took from its prefix cache instead of computing them


class Policy(Protocol):
    tokenizer: Tokenizer

    @property
    def weight_version(self) -> int: ...

    def reply(self, contexts: Sequence[Context], turn: int) -> list[Reply]:
        """One reply per context (a group's live branches, batched in one call), in order."""
        ...


class LLMPolicy:
    """Replies sampled by an LLM from the token ids of each context, as they are: no text round trip."""

    def __init__(self, llm: LLM, params: SamplingParams, return_routing: bool = False) -> None:
        # logprobs=0: the sampled token's own logprob, which is what a trainer's ratio needs
        self.params = dataclasses.replace(params, n=1, logprobs=0, return_routing=return_routing)
        self.llm = llm
        self.tokenizer = llm.tokenizer

    @property
    def weight_version(self) -> int:
        return self.llm.engine.weight_version

    def reply(self, contexts: Sequence[Context], turn: int) -> list[Reply]:
        replies = []
        for out in self.llm.generate([list(c.token_ids) for c in contexts], self.params):
            sample = out.outputs[0]
            logprobs = tuple(lp.logprob for lp in sample.logprobs or ())
            if len(logprobs) != len(sample.token_ids):
                raise AssertionError(f"engine returned {len(logprobs)} logprobs for {len(sample.token_ids)} tokens")
            replies.append(Reply(sample.token_ids, logprobs, sample.routing, self.llm.engine.weight_version, out.num_cached_tokens))
        return replies


class ScriptedPolicy:
    """Replies from `script(branch, turn)` (text, encoded once), each token with logprob 0.0 (certain)."""

    def __init__(self, tokenizer: Tokenizer, script: Callable[[int, int], str]) -> None:
        self.tokenizer = tokenizer
        self.script = script

    @property
    def weight_version(self) -> int:
        return 0

    def reply(self, contexts: Sequence[Context], turn: int) -> list[Reply]:
        out = []
        for c in contexts:
            ids = tuple(self.tokenizer.encode(self.script(c.branch, turn)))
            out.append(Reply(ids, (0.0,) * len(ids)))
        return out
