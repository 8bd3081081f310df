"""Policies for episodes run concurrently on one event loop (rl/async_episode.py): each branch asks for its own reply when
it is ready, so the engine decodes other episodes while one waits for its tool. AsyncEnginePolicy samples from the
server's front end (serve/async_engine.py: AsyncEngine), token ids in and out with each token's sampling logprob and
optionally routing, and says which weight version every reply was sampled with."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Protocol

from openk3.rl.policy import Context, Reply
from openk3.serve.async_engine import AsyncEngine
from openk3.serve.output import OutputKind
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import Tokenizer


class AsyncPolicy(Protocol):
    tokenizer: Tokenizer

    async def reply(self, context: Context, turn: int) -> Reply:
        """One reply to one branch's context."""
        ...


class AsyncEnginePolicy:
    """Replies sampled by an AsyncEngine from each context's token ids as they are (no text round trip)."""

    def __init__(self, frontend: AsyncEngine, params: SamplingParams, return_routing: bool = False, prefix: str = "episode") -> None:
        # logprobs=0: the sampled token's own logprob, which is what a trainer's ratio needs
        self.params = dataclasses.replace(params, n=1, logprobs=0, return_routing=return_routing)
        self.frontend = frontend
        self.tokenizer = frontend.engine.tokenizer
        self._ids = itertools.count()
        self._prefix = prefix

    async def reply(self, context: Context, turn: int) -> Reply:
        request_id = f"{self._prefix}-{next(self._ids)}"
        stream = await self.frontend.add(request_id, list(context.token_ids), self.params, OutputKind.FINAL_ONLY)
        try:
            async for out in stream:
                if out.finished:
                    sample = out.outputs[0]
                    logprobs = tuple(lp.logprob for lp in sample.logprobs or ())
                    if len(logprobs) != len(sample.token_ids):
                        raise AssertionError(f"engine returned {len(logprobs)} logprobs for {len(sample.token_ids)} tokens")
                    return Reply(sample.token_ids, logprobs, sample.routing, stream.weight_version, out.num_cached_tokens)
        finally:
            await stream.aclose()
        raise RuntimeError(f"request {request_id}: the stream ended without a final output")
