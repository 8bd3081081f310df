"""Request: one sequence being generated, and the outputs the engine hands back.

Ownership: the engine creates a Request and appends sampled tokens; the scheduler alone changes `status` and
`num_computed_tokens` (tokens whose cache is written). The scheduling rule needs nothing else: a request wants
`num_tokens - num_computed_tokens` more tokens computed.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from openk3.serve.sampling import SamplingParams


class RequestStatus(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # cache freed, back in the waiting queue; it recomputes from token 0
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass
class RequestTimings:
    """Wall-clock instants (time.monotonic seconds); None until the event happens."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


@dataclass(frozen=True)
class TokenLogprobs:
    """The sampled token's logprob and the top-k alternatives (token id -> logprob), from the model's raw distribution."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    parent_id: str | None = None  # the caller's id when this is one of n samples
    index: int = 0  # which of the n samples
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    output_text: str = ""
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    generator: torch.Generator | None = None  # per-request RNG when seeded; survives preemption so draws never repeat
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    snapshot_points: tuple[int, ...] = ()  # prompt positions where the prefix cache wants a state (detected branch points)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids is empty; expected at least one token")
        self.timings = RequestTimings(arrival=self.arrival_time)
        if self.sampling_params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Tokens that end the request once min_tokens are out (and are masked before that)."""
        ids = set(self.sampling_params.stop_token_ids)
        if self.eos_token_id is not None and not self.sampling_params.ignore_eos:
            ids.add(self.eos_token_id)
        return frozenset(ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None


@dataclass(frozen=True)
class RequestMetrics:
    arrival: float
    queue_time: float | None
    time_to_first_token: float | None
    e2e_latency: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int

    @property
    def time_per_output_token(self) -> float | None:
        """TPOT as vLLM's benchmark defines it: (e2e latency - TTFT) / (output tokens - 1)."""
        if self.e2e_latency is None or self.time_to_first_token is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_latency - self.time_to_first_token) / (self.num_output_tokens - 1)

    num_cached_tokens: int = 0


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    metrics: tuple[RequestMetrics, ...]  # one per completion
    prompt: str | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def stop_buffer_length(params: SamplingParams) -> int:
    """Characters a running request holds back so that a stream never shows the start of a stop string that is then cut (vLLM)."""
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop) - 1


def completion_of(req: Request) -> tuple[CompletionOutput, RequestMetrics]:
    t = req.timings
    logprobs = tuple(req.output_logprobs) if req.sampling_params.logprobs is not None else None
    completion = CompletionOutput(
        index=req.index,
        text=req.output_text if req.is_finished else req.output_text[: max(0, len(req.output_text) - stop_buffer_length(req.sampling_params))],
        token_ids=tuple(req.output_token_ids),
        finish_reason=req.status.finish_reason,
        stop_reason=req.stop_reason,
        logprobs=logprobs,
    )
    metrics = RequestMetrics(
        arrival=t.arrival,
        queue_time=t.queue_time,
        time_to_first_token=t.time_to_first_token,
        e2e_latency=t.e2e_latency,
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=req.num_output_tokens,
        num_preemptions=req.num_preemptions,
        num_cached_tokens=req.num_cached_tokens,
    )
    return completion, metrics
