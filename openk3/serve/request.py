"""Request: one sequence in the engine core, and what the core reports about it after each step.

Ownership: the engine creates a Request; the scheduler alone changes `status` and `num_computed_tokens` (tokens whose
cache is written) and appends sampled tokens. The scheduling rule needs nothing else: a request wants
`num_tokens - num_computed_tokens` more tokens computed. Whether a token ends it, and the text it adds, are
serve/stopping.py's (the core's); the n samples of a caller's request and how text reaches callers are serve/output.py's.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import torch

from openk3.serve.media_prompt import ImageSpan, cache_key_ids, check_spans
from openk3.serve.routing import RoutingTrace
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
    rank: int | None = None  # 1 + tokens the model found more likely; prompt logprobs only (vLLM reports it there)


class Request:
    """One sample of a prompt in the engine core: its tokens (prompt, then what it sampled, in one list that grows in place),
    its sampling parameters, its place in the schedule and its timings. The scheduler, the runner and the sampler all read
    this one object; nothing keeps a copy of its tokens."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        group_id: str | None = None,
        also_eos: frozenset[int] = frozenset(),
        generator: torch.Generator | None = None,
        arrival_time: float | None = None,
        images: tuple[ImageSpan, ...] = (),
    ) -> None:
        if sampling_params.n != 1:
            n = sampling_params.n
            raise ValueError(f"request {request_id!r}: n={n}; the engine core runs one sample per request (OutputProcessor fans n out)")
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.also_eos = also_eos  # the checkpoint's other end tokens (generation_config.json): each ends it as the eos does
        self.group_id = group_id  # the caller's request when this is one of its n samples (the scheduler shares slots by it)
        # prompt then outputs; the runner packs slices of it and the sampler reads it whole (penalties, grammars)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        check_spans(images, self.num_prompt_tokens)
        self.images = images  # the prompt's images and the positions of their media tokens (serve/media_prompt.py)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose cache is written: only the scheduler changes it
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it (None for EOS, length, abort)
        self.num_preemptions = 0
        self.arrival_seq = 0  # the scheduler's count of arrivals when this one came: ties of priority go by it (serve/policy.py)
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        # speculative decoding (serve/speculative.py): the draft tokens proposed for the coming step, after token_ids, and
        # the draft's distributions they were drawn from ([K, V]; None when greedy); never part of token_ids
        self.draft_token_ids: list[int] = []
        self.draft_probs: torch.Tensor | None = None
        self.snapshot_points: tuple[int, ...] = ()  # prompt positions where the prefix cache wants a state (detected branch points)
        self.timings = RequestTimings(arrival=time.monotonic() if arrival_time is None else arrival_time)
        # per-request RNG when seeded (on the engine's device); survives preemption: draws never repeat
        if generator is None and sampling_params.seed is not None:
            generator = torch.Generator().manual_seed(sampling_params.seed)
        self.generator = generator
        # tokens that end the request once min_tokens are out (and are masked before that); fixed for its life
        ids = set(sampling_params.stop_token_ids)
        if not sampling_params.ignore_eos:
            ids.update(also_eos)
            if eos_token_id is not None:
                ids.add(eos_token_id)
        self.stop_token_ids = frozenset(ids)

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, {self.status.value}, {self.num_computed_tokens}/{self.num_tokens} computed)"

    def append_output(self, token: int) -> None:
        self.token_ids.append(token)

    @property
    def group(self) -> str:
        """What the scheduler shares slots between: the caller's request (all its samples), or this request alone."""
        return self.group_id if self.group_id is not None else self.request_id

    def cache_key_ids(self, n: int | None = None) -> list[int]:
        """The first `n` tokens (default all) as the prefix cache keys them: image tokens by their image's digest."""
        return cache_key_ids(self.token_ids, self.images, n)

    @property
    def priority(self) -> int:
        return self.sampling_params.priority

    @property
    def client(self) -> tuple[str, str]:
        """Whose share it counts in under the fair policy: the client it names, or else its own caller's request (its n
        samples together), so that unnamed requests take turns as fcfs makes the samples of n > 1 requests take turns."""
        named = self.sampling_params.client
        return ("client", named) if named is not None else ("request", self.group)

    @property
    def cache_salt(self) -> str | None:
        return self.sampling_params.cache_salt

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

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
    finish_reason: str | None = None  # "stop" (a stop token or string) | "length"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string (None for EOS)
    metrics: RequestMetrics | None = None  # when finished
    new_text: str = ""  # the text the new tokens add (serve/stopping.py), after dropping the last `text_dropped` characters
    text_dropped: int = 0  # characters of text already reported that a stop string cut (never streamed: output.py holds them)
    # with the first token of a request that asked for prompt logprobs: prompt tokens 1.. scored (serve/prompt_logprobs.py)
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    routing: RoutingTrace | None = None  # when finished, for a request that asked (SamplingParams.return_routing)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
