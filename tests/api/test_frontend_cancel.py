"""A caller that leaves while its add (or call) waits behind a running engine step: the engine thread must neither answer a
cancelled future (which raised InvalidStateError and killed the engine loop for good) nor keep the request. The step is made
slow by a fake that blocks on an event the test sets, so the order is forced, not timed."""

from __future__ import annotations

import asyncio

import pytest

from openk3.serve.async_engine import AsyncEngine
from openk3.serve.sampling import SamplingParams
from tests.api.conftest import GatedStep, debug_engine

PROMPT = list(b"Once upon a time")


async def started(frontend: AsyncEngine, gate: GatedStep) -> asyncio.Future:
    """Request "a" running, and the engine thread held inside its first step."""
    first = asyncio.ensure_future(frontend.generate("a", PROMPT, SamplingParams(max_tokens=8, ignore_eos=True)).__anext__())
    await asyncio.to_thread(gate.entered.wait)
    return first


def check_alive_and_clean(frontend: AsyncEngine) -> None:
    assert frontend.is_healthy and frontend.error is None


@pytest.mark.parametrize("via", ["generate", "call"])
def test_leaving_while_queued_behind_a_step_keeps_the_engine_alive(torch_one_thread, via: str) -> None:
    async def check() -> None:
        engine = debug_engine()
        gate = GatedStep(engine, before=True)
        frontend = AsyncEngine(engine)
        frontend.start()
        try:
            first = await started(frontend, gate)

            async def leaver() -> None:
                if via == "generate":
                    async for _ in frontend.generate("b", PROMPT, SamplingParams(max_tokens=8)):
                        pass
                else:
                    await frontend.call(lambda e: e.has_unfinished())

            task = asyncio.ensure_future(leaver())
            for _ in range(100):  # a few loop turns: the task runs up to its await on the engine thread's answer
                await asyncio.sleep(0)
            assert not task.done()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            gate.release.set()
            await first
            check_alive_and_clean(frontend)
            pieces = [u async for u in frontend.generate("c", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))]
            assert pieces[-1].finished and pieces[-1].outputs[-1].finish_reason == "length"
            assert await frontend.call(lambda e: "b" in e.scheduler.requests) is False  # "b" was never added, or aborted
            check_alive_and_clean(frontend)
        finally:
            gate.release.set()
            await frontend.shutdown(timeout=5)
        assert frontend.error is None
        engine.check_integrity()
        assert not engine.has_unfinished() and engine.cache.num_free_pages == engine.cache.num_pages

    asyncio.run(check())


def test_leaving_after_the_add_ran_aborts_the_request(torch_one_thread) -> None:
    """The other order: the add has run when the caller leaves; the abort goes in behind it and frees everything."""

    async def check() -> None:
        engine = debug_engine(max_num_seqs=1)  # "b" stays waiting behind "a"
        frontend = AsyncEngine(engine)
        frontend.start()
        try:
            a = asyncio.ensure_future(_drain(frontend.generate("a", PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))))
            stream = await frontend.add("b", PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))
            assert await frontend.call(lambda e: "b" in e.scheduler.requests)
            await stream.aclose()
            assert await frontend.call(lambda e: "b" in e.scheduler.requests) is False
            await a
            check_alive_and_clean(frontend)
            assert frontend.num_active == 0
        finally:
            await frontend.shutdown(timeout=5)
        engine.check_integrity()

    asyncio.run(check())


async def _drain(gen) -> None:
    async for _ in gen:
        pass
