"""OutputProcessor: from the engine core's per-step outputs to what callers see -- the n samples, text as a whole or as deltas.

The core (engine.py) reports per step only what changed: each request's new token ids, their logprobs, the text they add
and why it ended; every stop rule, stop strings included, and the text they need are the core's (stopping.py). What is
left happens here, once, for `LLM` and the server alike:

- n fan-out: a caller's request with n > 1 becomes n core requests "{id}-{i}" (request_ids.py) with seeds seed + i (vLLM's
  rule); their outputs are regrouped under the caller's id, completions in index order.
- Hold-back: a streamed sample keeps its last max(len(stop)) - 1 characters unsent while they may still turn out to start
  a stop string (none with include_stop_str_in_output, when nothing would be cut), so a stream never shows text the core
  cuts later (the core reports such a cut as `text_dropped` characters, always within what was held back).
- Prompt logprobs belong to the caller's request: only its first sample scores the prompt (the others would score the same
  tokens again).
- Output kinds (vLLM's RequestOutputKind): DELTA -- every step, only what is new (the server's streams); FINAL_ONLY -- one
  output when every sample has ended, whole (LLM.generate, non-streaming responses).

The tool-call and reasoning parsers of the agent API plug in here, on the same per-sample text.
Threading: one thread owns a processor and its engine (the caller of LLM, or the AsyncEngine's engine thread).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from openk3.serve.engine_api import EngineCore
from openk3.serve.media_prompt import ImageSpan
from openk3.serve.output_types import (
    CompletionOutput,
    FinishedRequest,
    IterationStats,
    OutputKind,
    RequestOutput,
    find_stop_string,
    hold_back,
)
from openk3.serve.request import EngineCoreOutput, RequestMetrics, RequestStatus, TokenLogprobs
from openk3.serve.request_ids import sample_id
from openk3.serve.routing import RoutingTrace
from openk3.serve.sampling import SamplingParams

__all__ = ["CompletionOutput", "FinishedRequest", "IterationStats", "OutputKind", "OutputProcessor", "RequestOutput", "find_stop_string", "hold_back"]


@dataclass(eq=False)
class _Sample:
    index: int
    core_id: str
    params: SamplingParams
    hold: int
    streamed: bool  # DELTA: only what is not yet sent is kept; FINAL_ONLY: everything, for the one output at the end
    token_ids: list[int] = field(default_factory=list)  # DELTA: not yet sent
    logprobs: list[TokenLogprobs] | None = None  # DELTA: not yet sent
    parts: list[str] = field(default_factory=list)  # FINAL_ONLY: the whole text (joined once, at the end)
    unsent: str = ""  # DELTA: text not yet sent (at most `hold` characters between steps)
    last_token_time: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    metrics: RequestMetrics | None = None
    routing: RoutingTrace | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add_text(self, new: str, drop: int) -> None:
        """Append `new` after removing the last `drop` characters (a stop string that began in earlier text)."""
        if self.streamed:
            self.unsent = self.unsent[: len(self.unsent) - drop] + new  # hold-back kept the dropped characters unsent
            return
        while drop:
            last = self.parts.pop()
            if len(last) > drop:
                self.parts.append(last[: len(last) - drop])
                break
            drop -= len(last)
        if new:
            self.parts.append(new)


@dataclass(eq=False)
class _Group:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    prompt: str | None
    kind: OutputKind
    samples: list[_Sample]
    num_cached_tokens: int = 0
    started: bool = False
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    prompt_logprobs_sent: bool = False  # DELTA: they go out once
    arrival: float = field(default_factory=time.monotonic)  # when the caller's request reached the engine

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


EngineT = TypeVar("EngineT", bound=EngineCore)


class OutputProcessor(Generic[EngineT]):
    """Owns, for one engine, every caller request's samples, their text and their stop strings (module docstring)."""

    def __init__(self, engine: EngineT) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._groups: dict[str, _Group] = {}
        self._by_core_id: dict[str, tuple[_Group, _Sample]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    @property
    def num_unfinished(self) -> int:
        return len(self._groups)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        kind: OutputKind = OutputKind.FINAL_ONLY,
        add_special_tokens: bool = True,
        images: tuple[ImageSpan, ...] = (),
    ) -> list[str]:
        """Queue a prompt (text, tokenised with the tokenizer's special tokens by default as vLLM does for completions, or
        token ids, with `images` placed in them: serve/media_prompt.py); returns the ids of its core requests. On any error
        nothing stays queued."""
        params = params or SamplingParams()
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens) if isinstance(prompt, str) else list(prompt)
        core_ids = [request_id] if params.n == 1 else [sample_id(request_id, i) for i in range(params.n)]
        samples = []
        try:
            for i, core_id in enumerate(core_ids):
                child = params if params.n == 1 else params.for_child(i)
                if i and child.prompt_logprobs is not None:
                    child = child.replace(prompt_logprobs=None)
                self.engine.add_request(core_id, ids, child, group_id=request_id if params.n > 1 else None, images=images)
                logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
                samples.append(_Sample(i, core_id, child, hold_back(params), kind == OutputKind.DELTA, logprobs=logprobs))
        except BaseException:
            for s in samples:
                self.engine.abort(s.core_id)
            raise
        group = _Group(request_id, tuple(ids), prompt if isinstance(prompt, str) else None, kind, samples)
        self._groups[request_id] = group
        for s in samples:
            self._by_core_id[s.core_id] = (group, s)
        return core_ids

    def abort(self, request_id: str, stats: IterationStats | None = None) -> RequestOutput | None:
        """End a caller's request wherever it is (its core requests free their pages and slots at once); returns its last
        output (every sample still running ends with "abort"), or None for an unknown or finished id."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        changed = []
        for s in group.samples:
            del self._by_core_id[s.core_id]
            if not s.finished:
                metrics = self.engine.finish(s.core_id, RequestStatus.FINISHED_ABORTED)
                s.finish_reason = RequestStatus.FINISHED_ABORTED.finish_reason
                changed.append(s)
                if stats is not None:
                    stats.finished.append(_finished("abort", metrics))
        return self._output(group, changed)

    def process(self, core_outputs: list[EngineCoreOutput], stats: IterationStats | None = None) -> list[RequestOutput]:
        """One step's core outputs -> the caller outputs due (per the requests' kinds), in first-seen order; `stats`, when
        given, gets the step's latencies, started prompts and ended samples."""
        now = time.monotonic()
        changed: dict[str, tuple[_Group, list[_Sample]]] = {}
        for out in core_outputs:
            found = self._by_core_id.get(out.request_id)
            if found is None:
                continue  # aborted while the step ran
            group, sample = found
            self._advance(group, sample, out)
            changed.setdefault(group.request_id, (group, []))[1].append(sample)
            if stats is not None:
                self._record(stats, group, sample, len(out.new_token_ids), now)
        results = []
        for group, samples in changed.values():
            output = self._output(group, sorted(samples, key=lambda s: s.index))
            if output is not None:
                results.append(output)
            if group.finished:
                del self._groups[group.request_id]
                for s in group.samples:
                    del self._by_core_id[s.core_id]
        return results

    @staticmethod
    def _record(stats: IterationStats, group: _Group, s: _Sample, num_new: int, now: float) -> None:
        if s.last_token_time is not None and num_new:
            stats.inter_token_latencies.extend([(now - s.last_token_time) / num_new] * num_new)
        elif num_new:  # its first token: recorded now, so that a sample aborted later still counts
            stats.first_token_latencies.append(now - group.arrival)
        s.last_token_time = now
        if not group.started:
            group.started = True
            stats.prompts.append((len(group.prompt_token_ids), group.num_cached_tokens))
        if s.finished:
            stats.finished.append(_finished(s.finish_reason or "abort", s.metrics))

    @staticmethod
    def _advance(group: _Group, s: _Sample, out: EngineCoreOutput) -> None:
        if s.index == 0:
            group.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None:
                group.prompt_logprobs = out.prompt_logprobs
        s.token_ids.extend(out.new_token_ids)
        if s.logprobs is not None and out.new_logprobs is not None:
            s.logprobs.extend(out.new_logprobs)
        if out.finish_reason is not None:
            s.finish_reason, s.stop_reason, s.metrics, s.routing = out.finish_reason, out.stop_reason, out.metrics, out.routing
        s.add_text(out.new_text, out.text_dropped)

    def _output(self, group: _Group, samples: list[_Sample]) -> RequestOutput | None:
        if group.kind == OutputKind.FINAL_ONLY:
            if not group.finished:
                return None
            outputs = tuple(self._whole(s) for s in group.samples)
            prompt_logprobs = group.prompt_logprobs
        else:
            outputs = tuple(self._delta(s) for s in samples)
            prompt_logprobs = None if group.prompt_logprobs_sent else group.prompt_logprobs
            group.prompt_logprobs_sent = group.prompt_logprobs_sent or prompt_logprobs is not None
        return RequestOutput(group.request_id, group.prompt_token_ids, outputs, group.finished, group.num_cached_tokens, group.prompt, prompt_logprobs)

    @staticmethod
    def _whole(s: _Sample) -> CompletionOutput:
        logprobs = None if s.logprobs is None else tuple(s.logprobs)
        return CompletionOutput(s.index, "".join(s.parts), tuple(s.token_ids), s.finish_reason, s.stop_reason, logprobs, s.metrics, s.routing)

    @staticmethod
    def _delta(s: _Sample) -> CompletionOutput:
        """What is new since this sample's last output: its new tokens at once, its text but the held-back end."""
        # an aborted sample never learns whether its held-back end starts a stop string: that text stays unsent
        keep = 0 if s.finished and s.finish_reason != "abort" else min(s.hold, len(s.unsent))
        text, s.unsent = s.unsent[: len(s.unsent) - keep], s.unsent[len(s.unsent) - keep :]
        tokens, s.token_ids = tuple(s.token_ids), []
        logprobs = None
        if s.logprobs is not None:
            logprobs, s.logprobs = tuple(s.logprobs), []
        return CompletionOutput(s.index, text, tokens, s.finish_reason, s.stop_reason, logprobs, s.metrics, s.routing)


def _finished(reason: str, m: RequestMetrics | None) -> FinishedRequest:
    if m is None:
        return FinishedRequest(reason, None, None, None)
    return FinishedRequest(reason, m.queue_time, m.time_to_first_token, m.e2e_latency, m.prefill_time, m.decode_time, m.num_output_tokens)
