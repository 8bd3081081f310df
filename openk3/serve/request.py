"""Request: one sequence in the engine core, and what the core reports about it after each step.

Ownership: the engine creates a Request and appends sampled tokens; the scheduler alone changes `status` and
`num_computed_tokens` (tokens whose cache is written). The scheduling rule needs nothing else: a request wants
`num_tokens - num_computed_tokens` more tokens computed. Text, stop strings and the n samples of a caller's request are
not the core's business: serve/output.py turns the core's per-step `EngineCoreOutput`s into what callers see.
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
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    stop_reason: int | None = None  # the stop token id that ended it (None for EOS and for every other end)
    num_preemptions: int = 0
    generator: torch.Generator | None = None  # per-request RNG when seeded (on the engine's device); survives preemption: draws never repeat
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    snapshot_points: tuple[int, ...] = ()  # prompt positions where the prefix cache wants a state (detected branch points)
    group_id: str | None = None  # the caller's request when this is one of its n samples (the scheduler shares slots by it)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids is empty; expected at least one token")
        if self.sampling_params.n != 1:
            n = self.sampling_params.n
            raise ValueError(f"request {self.request_id!r}: n={n}; the engine core runs one sample per request (OutputProcessor fans n out)")
        self.timings = RequestTimings(arrival=self.arrival_time)
        if self.sampling_params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)
        # tokens that end the request once min_tokens are out (and are masked before that); fixed for its life
        ids = set(self.sampling_params.stop_token_ids)
        if self.eos_token_id is not None and not self.sampling_params.ignore_eos:
            ids.add(self.eos_token_id)
        self.stop_token_ids = frozenset(ids)

    @property
    def group(self) -> str:
        """What the scheduler shares slots between: the caller's request (all its samples), or this request alone."""
        return self.group_id if self.group_id is not None else self.request_id

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
    def is_finished(self) -> bool:
        return self.status.finished

    def metrics(self) -> RequestMetrics:
        t = self.timings
        return RequestMetrics(
            arrival=t.arrival,
            queue_time=t.queue_time,
            time_to_first_token=t.time_to_first_token,
            e2e_latency=t.e2e_latency,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_preemptions=self.num_preemptions,
            num_cached_tokens=self.num_cached_tokens,
            decode_time=None if t.first_token is None or t.last_token is None else t.last_token - t.first_token,
        )


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
    decode_time: float | None = None  # first token -> last token

    @property
    def prefill_time(self) -> float | None:
        """First scheduled -> first token."""
        return None if self.time_to_first_token is None or self.queue_time is None else self.time_to_first_token - self.queue_time


@dataclass(frozen=True, slots=True)
class EngineCoreOutput:
    """What one step did to one request: the tokens it sampled (usually one) and, when the request ended, why and its
    metrics. O(1) per request and step whatever the context length: nothing already reported is repeated."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprobs, ...] | None  # None unless the request asked for logprobs
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    finish_reason: str | None = None  # "stop" (a stop token) | "length"; None while running
    stop_reason: int | None = None  # the stop token id (None for EOS)
    metrics: RequestMetrics | None = None  # when finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
