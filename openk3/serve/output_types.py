"""What the OutputProcessor (output.py) hands its callers: RequestOutputs of one of two kinds, the per-step stats for
metrics, and the two stop-string rules (where to look, how much to hold back)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from openk3.serve.request import RequestMetrics, TokenLogprobs
from openk3.serve.routing import RoutingTrace
from openk3.serve.sampling import SamplingParams


class OutputKind(str, enum.Enum):
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass(frozen=True)
class CompletionOutput:
    """One sample: with DELTA the text, ids and logprobs new since the last output, with FINAL_ONLY all of them."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: tuple[TokenLogprobs, ...] | None = None  # None unless asked for
    metrics: RequestMetrics | None = None  # once it has finished (None for an abort)
    # once it has finished, when asked for (SamplingParams.return_routing): prompt and generated tokens but the last
    routing: RoutingTrace | None = None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: tuple[int, ...]  # the same tuple in every output of a request (made once)
    outputs: tuple[CompletionOutput, ...]  # DELTA: the samples that changed this step; FINAL_ONLY: all n; index order
    finished: bool  # every sample has ended
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (the first sample's)
    prompt: str | None = None
    # prompt tokens 1.. scored (serve/prompt_logprobs.py) when asked for: DELTA in the first output after they are known, once
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    weight_version: int = 0  # the weights it ran on, in a final output of the server's front end (api/updates.py)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass(frozen=True)
class FinishedRequest:
    """One sample that ended; seconds are None where it never got that far (an abort before its first token)."""

    finish_reason: str
    queue_time: float | None  # arrival -> first scheduled
    time_to_first_token: float | None  # arrival -> first token
    e2e_latency: float | None  # arrival -> finished
    prefill_time: float | None = None  # first scheduled -> first token
    decode_time: float | None = None  # first token -> last token
    num_generation_tokens: int = 0

    @property
    def inference_time(self) -> float | None:
        """First scheduled -> last token."""
        return None if self.prefill_time is None or self.decode_time is None else self.prefill_time + self.decode_time

    @property
    def time_per_output_token(self) -> float | None:
        """The sample's decode time / (generated tokens - 1), for two tokens or more."""
        return None if self.decode_time is None or self.num_generation_tokens < 2 else self.decode_time / (self.num_generation_tokens - 1)


@dataclass
class IterationStats:
    """What one step did, for metrics (vLLM's IterationStats), whatever kind of output its requests asked for."""

    inter_token_latencies: list[float] = field(default_factory=list)  # seconds, one per new token after a sample's first
    first_token_latencies: list[float] = field(default_factory=list)  # arrival -> first token, per sample that got it this step
    prompts: list[tuple[int, int]] = field(default_factory=list)  # (prompt tokens, of which cached) of requests that started
    finished: list[FinishedRequest] = field(default_factory=list)  # one per sample that ended


def find_stop_string(text: str, num_new_chars: int, stops: tuple[str, ...], include: bool) -> tuple[str, int] | None:
    """The first stop string (in the caller's order) that ends in the last `num_new_chars` of `text`, and where to cut."""
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1:
            return stop, idx + len(stop) if include else idx
    return None


def hold_back(params: SamplingParams) -> int:
    """Characters a streamed sample keeps unsent so that it never shows the start of a stop string that is then cut."""
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop) - 1
