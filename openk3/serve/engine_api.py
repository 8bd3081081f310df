"""What drives an engine and what the server reads of one: EngineCore (OutputProcessor and LLM step it), ServedEngine (the
HTTP server's view besides stepping) and EngineStats (a snapshot for metrics). LLMEngine (serve/engine.py) is one; an
engine spread over data-parallel ranks (openk3.parallel.dp.DataParallelEngine) is another."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from openk3.config import ModelConfig
from openk3.config.vision import VisionConfig
from openk3.serve.cache.manager import CacheManager
from openk3.serve.cache.stats import PrefixCacheStats
from openk3.serve.config import EngineConfig
from openk3.serve.media_prompt import ImageSpan
from openk3.serve.request import EngineCoreOutput, RequestMetrics, RequestStatus
from openk3.serve.runner import CausalLM
from openk3.serve.sampling import SamplingParams
from openk3.serve.speculative import SpecDecodeStats
from openk3.serve.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics (vLLM's names without the prefix)."""

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float  # fraction of MLA pages held
    state_slots_used: int
    num_pages: int  # MLA cache pages (with data-parallel attention: over every rank's engine)
    num_free_pages: int
    num_state_slots: int  # KDA state slots of running requests
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache: PrefixCacheStats | None = None  # None while prefix caching is off
    spec_decode: SpecDecodeStats | None = None  # running totals of speculative decoding; None without a draft model


class EngineCore(Protocol):
    """What OutputProcessor and LLM drive: LLMEngine, or an engine of the same surface spread over ranks
    (openk3.parallel.dp.DataParallelEngine)."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def model(self) -> CausalLM: ...

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        group_id: str | None = None,
        images: tuple[ImageSpan, ...] = (),
    ) -> None: ...

    def finish(self, request_id: str, status: RequestStatus) -> RequestMetrics | None: ...

    def abort(self, request_id: str) -> None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[EngineCoreOutput]: ...

    def close(self) -> None: ...


class ServedEngine(EngineCore, Protocol):
    """What the HTTP server (serve/async_engine.py, serve/admission.py, api/metrics.py) reads of an engine besides stepping it.
    `cache` is one engine's cache manager, for its layout (page size, per-page and per-slot bytes, dtype); how much of
    every pool is used comes from stats(), which with data-parallel attention covers every rank."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def cache(self) -> CacheManager: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vision(self) -> VisionConfig | None:
        """The vision tower's config when add_request takes images, else None."""
        ...

    @property
    def model_config(self) -> ModelConfig: ...

    @property
    def num_engines(self) -> int:
        """Engines behind this one (data-parallel ranks; 1 for LLMEngine), each with `config`'s sequences and `cache`'s pages."""
        ...

    @property
    def weight_version(self) -> int:
        """How many times the weights were replaced in place (0: as built); what every response reports."""
        ...

    def stats(self) -> EngineStats: ...

    def was_scheduled(self, request_id: str) -> bool | None: ...

    def check_integrity(self) -> None: ...
