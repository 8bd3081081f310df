"""Issue 36 item 1: once the engine has failed (its step raised, or the rank heartbeat declared it dead while the step is
still stuck in a collective) every caller gets EngineDeadError at once -- open streams, adds queued behind the stuck step,
and every later add -- and over HTTP that is a 503 with an OpenAI error body and Retry-After, as is /health, which says
why. A step running past step_timeout_s refuses new adds at once. Steps are held on events and the clock is a counter the
test moves; the engine thread is never raced."""

from __future__ import annotations

import argparse
import asyncio
import threading

import httpx
import pytest

from openk3.api.errors import APIError
from openk3.api.routes.state import check_open
from openk3.serve.async_engine import AsyncEngine, EngineDeadError, EngineStalledError
from openk3.serve.config import FrontendConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.sampling import SamplingParams
from tests.api.conftest import debug_engine, start_server, stop_server

PROMPT = list(b"Once upon a time")
LONG = SamplingParams(max_tokens=64, ignore_eos=True)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class StuckStep:
    """The engine's first step waits on `release` (as rank 0 waits in a collective for a stalled rank), then raises
    `error` if one is given; later steps are the real ones."""

    def __init__(self, engine: LLMEngine, error: Exception | None = None) -> None:
        self.step, self.error = engine.step, error
        self.entered, self.release = threading.Event(), threading.Event()
        self.calls = 0
        engine.step = self  # type: ignore[method-assign]  # the test holds the step on purpose

    def __call__(self) -> list:
        self.calls += 1
        if self.calls > 1:
            return self.step()
        self.entered.set()
        self.release.wait()
        if self.error is not None:
            raise self.error
        return self.step()


async def first_output(frontend: AsyncEngine, request_id: str) -> asyncio.Future:
    return asyncio.ensure_future(frontend.generate(request_id, PROMPT, LONG).__anext__())


def test_an_add_queued_behind_the_failing_step_is_refused_not_admitted(torch_one_thread) -> None:
    """Before: the add ran after the failure, entered the dead engine and waited for ever."""

    async def check() -> None:
        engine = debug_engine()
        stuck = StuckStep(engine, RuntimeError("rank 1 is gone"))
        frontend = AsyncEngine(engine)
        frontend.start()
        try:
            running = await first_output(frontend, "running")
            await asyncio.to_thread(stuck.entered.wait)
            queued = await first_output(frontend, "queued")
            stuck.release.set()
            for task in (running, queued):
                with pytest.raises(EngineDeadError, match="rank 1 is gone"):
                    await task
            with pytest.raises(EngineDeadError, match="rank 1 is gone"):
                await frontend.add("after", PROMPT, LONG)
            assert not await asyncio.to_thread(lambda: engine.has_unfinished())  # nothing was admitted into the dead engine
        finally:
            stuck.release.set()
            await frontend.shutdown(timeout=5)
        assert frontend.num_active == 0

    asyncio.run(check())


def test_fail_from_outside_answers_everyone_while_the_step_is_still_stuck(torch_one_thread) -> None:
    async def check() -> None:
        engine = debug_engine()
        stuck = StuckStep(engine)
        frontend = AsyncEngine(engine)
        failures: list[BaseException] = []
        frontend.on_failure = failures.append
        frontend.start()
        try:
            running = await first_output(frontend, "running")
            await asyncio.to_thread(stuck.entered.wait)
            queued = await first_output(frontend, "queued")
            await asyncio.sleep(0)  # the add is submitted behind the stuck step
            heartbeat = threading.Thread(target=frontend.fail, args=(RuntimeError("rank 1 missed its heartbeats"),))
            heartbeat.start()
            heartbeat.join()
            for task in (running, queued):  # answered while the engine thread is still inside the step
                with pytest.raises(EngineDeadError, match="missed its heartbeats"):
                    await task
            with pytest.raises(EngineDeadError, match="missed its heartbeats"):
                await frontend.add("after", PROMPT, LONG)
            assert not stuck.release.is_set() and not frontend.is_healthy
            frontend.fail(RuntimeError("a second report"))
            assert len(failures) == 1 and "missed its heartbeats" in str(failures[0])
        finally:
            stuck.release.set()  # the step returns; the engine thread drops what it still holds
            await frontend.shutdown(timeout=5)
        assert frontend.num_active == 0
        assert not engine.has_unfinished()

    asyncio.run(check())


def test_a_stalled_step_refuses_new_requests_at_once_and_keeps_the_running_ones(torch_one_thread) -> None:
    async def check() -> None:
        engine, clock = debug_engine(), Clock()
        stuck = StuckStep(engine)
        frontend = AsyncEngine(engine, config=FrontendConfig(step_timeout_s=30), clock=clock)
        frontend.start()
        try:
            running = await first_output(frontend, "running")
            await asyncio.to_thread(stuck.entered.wait)
            clock.now = 31.0
            with pytest.raises(EngineStalledError, match="has run for 31 s, longer than step_timeout_s 30"):
                await frontend.add("new", PROMPT, LONG)
            with pytest.raises(APIError) as health:  # what /health and a new completion answer, before any add
                check_open(argparse.Namespace(frontend=frontend))  # type: ignore[arg-type]  # check_open reads only .frontend
            assert (health.value.status, health.value.code, health.value.headers) == (503, "engine_stalled", {"Retry-After": "1"})
            stuck.release.set()
            assert (await running).request_id == "running"  # the stall ended: the running request goes on
            clock.now = 0.0
        finally:
            stuck.release.set()
            await frontend.shutdown(timeout=5)

    asyncio.run(check())


def test_http_after_a_failure_is_an_immediate_503_with_an_openai_body_and_retry_after(torch_one_thread) -> None:
    holder: dict[str, StuckStep] = {}

    def hold(engine: LLMEngine) -> None:
        holder["stuck"] = StuckStep(engine)

    live = start_server(before_start=hold)
    stuck = holder["stuck"]
    try:
        with httpx.Client(base_url=live.base_url, timeout=30) as client:
            body = {"model": "debug", "prompt": "Once", "max_tokens": 4}
            assert client.get("/health").status_code == 200
            in_flight = threading.Thread(target=lambda: holder.setdefault("answer", client.post("/v1/completions", json=body)))  # type: ignore[func-returns-value, arg-type]
            in_flight.start()
            stuck.entered.wait()
            live.frontend.fail(RuntimeError("rank 1 missed its heartbeats"))
            in_flight.join()
            answers = [holder["answer"], client.post("/v1/completions", json=body), client.get("/health")]  # type: ignore[list-item]
            for answer in answers:
                assert isinstance(answer, httpx.Response)
                assert answer.status_code == 503 and answer.headers["retry-after"] == "5"
                error = answer.json()["error"]
                assert error["type"] == "service_unavailable_error" and error["code"] == "unavailable"
                assert "rank 1 missed its heartbeats" in error["message"]
    finally:
        stuck.release.set()
        stop_server(live)
