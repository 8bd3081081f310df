"""The per-request metrics (TTFT at the first token, also for aborted requests; TPOT, prefill, decode, token counts), the
iteration-token histogram, cache_config_info, prefix-cache counters with caching off, and the process collectors -- through
the real AsyncEngine loop with ServerMetrics as its observer. Steps are held on semaphores, never timed."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from openk3.api.metrics import ServerMetrics
from openk3.serve.async_engine import AsyncEngine
from openk3.serve.engine import LLMEngine
from openk3.serve.output import OutputKind
from openk3.serve.sampling import SamplingParams
from tests.api.conftest import NUM_PAGES, PAGE_SIZE, debug_engine, metric

PROMPT = list(b"Once upon a time")
Test = Callable[[AsyncEngine, LLMEngine, ServerMetrics], Awaitable[None]]


class CountedSteps:
    """The engine's step, each one waiting for a permit; `entered[k]` is set when step k (from 1) begins, so a test knows
    that everything after step k-1 -- its outputs, its stats, the observer's snapshot -- is done."""

    def __init__(self, engine: LLMEngine, max_steps: int = 64) -> None:
        self.step = engine.step
        self.permits = threading.Semaphore(0)
        self.entered = [threading.Event() for _ in range(max_steps + 2)]
        self.count = 0
        engine.step = self  # type: ignore[method-assign]  # the test paces the engine on purpose

    def __call__(self):
        self.count += 1
        self.entered[min(self.count, len(self.entered) - 1)].set()
        self.permits.acquire()
        return self.step()


def run_frontend(test: Test, **engine_overrides: Any) -> str:
    """Run `test` against a started AsyncEngine observed by a fresh ServerMetrics; the metrics text once all is in."""
    metrics = ServerMetrics("m")
    engine = debug_engine(**engine_overrides)

    async def body() -> None:
        frontend = AsyncEngine(engine, observer=metrics)
        metrics.observe_engine(engine)  # as the server's lifespan does, before the engine thread starts
        frontend.start()
        try:
            await test(frontend, engine, metrics)
            await frontend.call(lambda e: None)  # every step before this one has its stats and snapshot in
        finally:
            await frontend.shutdown(timeout=5)

    asyncio.run(body())
    return metrics.render().decode()


def count_sum(text: str, name: str) -> tuple[float, float]:
    return metric(text, f"{name}_count"), metric(text, f"{name}_sum")


def test_ttft_is_recorded_at_the_first_token_and_kept_for_an_aborted_request(torch_one_thread) -> None:
    seen: dict[str, float] = {}

    async def test(frontend: AsyncEngine, engine: LLMEngine, metrics: ServerMetrics) -> None:
        steps = CountedSteps(engine)
        stream = await frontend.add("r", PROMPT, SamplingParams(max_tokens=100, ignore_eos=True), OutputKind.DELTA)
        steps.permits.release()  # step 1: the whole prompt, and the first token
        first = await stream.__anext__()
        assert len(first.outputs[0].token_ids) == 1
        await asyncio.to_thread(steps.entered[2].wait)  # step 1's snapshot is done; step 2 waits for its permit
        seen["ttft"] = metric(metrics.render().decode(), "time_to_first_token_seconds_count")
        await stream.aclose()  # the abort waits behind step 2
        steps.permits.release(100)
        assert await frontend.call(lambda e: not e.has_unfinished())

    text = run_frontend(test)
    assert seen["ttft"] == 1  # recorded when the first token left, not when the request ended
    assert metric(text, "time_to_first_token_seconds_count") == 1  # and only once
    assert 'finished_reason="abort"' in text
    assert count_sum(text, "request_generation_tokens") == (1, 2)  # aborted after its second step: two tokens
    for name in ("request_time_per_output_token_seconds", "request_decode_time_seconds", "request_prefill_time_seconds", "request_inference_time_seconds"):
        assert metric(text, f"{name}_count") == 1, name


def test_every_sample_counts_once_whether_it_ends_in_its_first_step_or_later(torch_one_thread) -> None:
    params = [
        SamplingParams(max_tokens=1, ignore_eos=True),  # added and ended within one step: only its FinishedRequest is left
        SamplingParams(max_tokens=1, ignore_eos=True),
        SamplingParams(max_tokens=4, ignore_eos=True),
        SamplingParams(n=2, max_tokens=3, ignore_eos=True, temperature=1.0, seed=1),
    ]

    async def test(frontend: AsyncEngine, engine: LLMEngine, metrics: ServerMetrics) -> None:
        async def one(i: int, p: SamplingParams) -> None:
            async for _ in frontend.generate(f"r{i}", PROMPT, p, OutputKind.FINAL_ONLY):
                pass

        await asyncio.gather(*(one(i, p) for i, p in enumerate(params)))

    text = run_frontend(test)
    samples, tokens = 1 + 1 + 1 + 2, 1 + 1 + 4 + 2 * 3
    assert metric(text, "time_to_first_token_seconds_count") == samples
    assert count_sum(text, "request_generation_tokens") == (samples, tokens)
    assert metric(text, "generation_tokens_total") == tokens
    assert metric(text, "request_time_per_output_token_seconds_count") == 3  # the samples with two tokens or more
    assert metric(text, "request_prefill_time_seconds_count") == samples and metric(text, "request_decode_time_seconds_count") == samples
    assert count_sum(text, "request_prompt_tokens") == (len(params), len(params) * len(PROMPT))  # per prompt (n shares one)
    # every token sampled, plus each prompt in the step that ended its prefill
    assert metric(text, "iteration_tokens_total_sum") == tokens + len(params) * len(PROMPT)
    assert metric(text, "prefix_cache_queries_total") == 0 and metric(text, "prefix_cache_hits_total") == 0  # caching is off


def test_prefix_cache_counters_with_caching_on(torch_one_thread) -> None:
    async def test(frontend: AsyncEngine, engine: LLMEngine, metrics: ServerMetrics) -> None:
        for i, prompt in enumerate((PROMPT * 8, PROMPT * 8 + list(b" again"))):  # the second continues the first
            async for _ in frontend.generate(f"r{i}", prompt, SamplingParams(max_tokens=2, ignore_eos=True), OutputKind.FINAL_ONLY):
                pass

    text = run_frontend(test, enable_prefix_caching=True, prefix_match_unit=PAGE_SIZE)
    assert metric(text, "prefix_cache_queries_total") == 2 * 8 * len(PROMPT) + len(b" again")
    assert metric(text, "prefix_cache_hits_total") > 0  # the second starts from the first one's prompt
    assert 'enable_prefix_caching="True"' in text


def test_cache_config_info_and_process_collectors(torch_one_thread) -> None:
    metrics = ServerMetrics("m")
    metrics.observe_engine(debug_engine())
    text = metrics.render().decode()
    info = next(line for line in text.splitlines() if line.startswith("openk3:cache_config_info{"))
    for label in (f'page_size="{PAGE_SIZE}"', f'num_pages="{NUM_PAGES}"', 'enable_prefix_caching="False"', 'cache_dtype="float32"', 'model_name="m"'):
        assert label in info, label
    assert info.endswith(" 1.0")
    assert "python_info{" in text
    if sys.platform.startswith("linux"):
        assert "\nprocess_resident_memory_bytes " in text and "\nprocess_cpu_seconds_total " in text


def test_the_live_server_serves_the_new_families(http) -> None:
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True}).status_code == 200
    text = http.get("/metrics").text
    for name in ("request_time_per_output_token_seconds", "request_prefill_time_seconds", "request_decode_time_seconds", "request_prompt_tokens"):
        assert f"openk3:{name}_bucket" in text, name
    assert metric(text, "iteration_tokens_total_count") >= 1 and "openk3:cache_config_info{" in text
