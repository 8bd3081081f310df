"""Liveness (issue: a stalled expert-parallel rank hung every request while /health said 200; a dead one left rank 0
answering 503 for ever): /health turns 503 while a step runs past --step-timeout-s, the server process ends non-zero once
the engine loop fails, and the expert-parallel group's collectives get --ep-timeout-s. Steps are held on events and the
clock is a counter the test moves: nothing is timed."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import threading

import pytest

from openk3.api.routes.state import check_open
from openk3.launch import server as cli
from openk3.serve.async_engine import AsyncEngine
from openk3.serve.config import FrontendConfig
from openk3.serve.sampling import SamplingParams
from tests.api.conftest import GatedStep, debug_engine

PROMPT = list(b"Once upon a time")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_step_running_past_the_timeout_is_unhealthy_until_it_ends(torch_one_thread) -> None:
    async def check() -> None:
        engine, clock = debug_engine(), Clock()
        gate = GatedStep(engine, before=True)
        frontend = AsyncEngine(engine, config=FrontendConfig(step_timeout_s=30), clock=clock)
        frontend.start()
        try:
            first = asyncio.ensure_future(frontend.generate("a", PROMPT, SamplingParams(max_tokens=2, ignore_eos=True)).__anext__())
            await asyncio.to_thread(gate.entered.wait)
            clock.now = 30.0
            assert frontend.is_healthy and frontend.stalled_for() is None  # at the limit, not past it
            clock.now = 31.5
            assert not frontend.is_healthy and frontend.stalled_for() == 31.5
            served = argparse.Namespace(frontend=frontend)
            with pytest.raises(Exception, match="current step has run for 32 s, longer than --step-timeout-s 30"):
                check_open(served)  # type: ignore[arg-type]  # check_open reads only .frontend
            gate.release.set()
            await first
            assert frontend.is_healthy  # the step ended: healthy again, nothing was lost
        finally:
            gate.release.set()
            await frontend.shutdown(timeout=5)

    asyncio.run(check())


def test_the_server_ends_non_zero_once_the_engine_loop_fails(monkeypatch: pytest.MonkeyPatch, torch_one_thread) -> None:
    """serve_until_stopped with uvicorn's Server replaced by one that sends a request into a failing step and then waits,
    as uvicorn's main loop does, for `should_exit`."""
    engine = debug_engine()

    def broken_step() -> list:
        raise RuntimeError("rank 1 is gone")

    engine.step = broken_step  # type: ignore[method-assign]  # the test injects the failure on purpose
    frontend = AsyncEngine(engine)
    stopped = threading.Event()

    class FakeServer:
        def __init__(self, config: object) -> None:
            self.should_exit = False

        def run(self) -> None:
            async def serve() -> None:
                frontend.start()
                with pytest.raises(Exception, match="rank 1 is gone"):
                    async for _ in frontend.generate("r", PROMPT, SamplingParams(max_tokens=2)):
                        pass
                await asyncio.to_thread(stopped.wait, 10)
                assert self.should_exit  # the failure told the server to stop
                await frontend.shutdown(timeout=1)

            asyncio.run(serve())

    class App:
        state = argparse.Namespace(served=argparse.Namespace(frontend=frontend))

    monkeypatch.setattr("uvicorn.Server", FakeServer)
    monkeypatch.setattr("uvicorn.Config", lambda app, **options: options)
    monkeypatch.setattr(cli, "_uvicorn_options", lambda args: {})
    real_fail = frontend._fail

    def fail_then_signal(error: Exception) -> None:
        real_fail(error)
        stopped.set()

    monkeypatch.setattr(frontend, "_fail", fail_then_signal)
    assert cli.serve_until_stopped(App(), argparse.Namespace()) == 1  # type: ignore[arg-type]


def test_the_expert_parallel_group_gets_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    from openk3.parallel import launch
    from openk3.parallel.config import ParallelConfig

    seen: dict[str, object] = {}

    def fake_init(backend: str, **kwargs: object) -> None:
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(launch.dist, "init_process_group", fake_init)
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(key, value)
    with pytest.raises(RuntimeError, match="stop here"):
        launch.init_from_env("cpu", datetime.timedelta(seconds=ParallelConfig(ep_timeout_s=12).ep_timeout_s))
    assert seen["timeout"] == datetime.timedelta(seconds=12)
    with pytest.raises(ValueError, match="ep_timeout_s"):
        ParallelConfig(ep_timeout_s=0)
