"""AsyncEngine without HTTP: deltas add up to the offline engine's text, stop strings are never half-sent, leaving aborts,
shutdown aborts what is left and frees everything, and an engine failure reaches every waiting request."""

from __future__ import annotations

import asyncio

import pytest
import torch

from openk3.llm import LLM
from openk3.serve.async_engine import AsyncEngine, EngineDeadError, FrontendClosedError
from openk3.serve.sampling import SamplingParams
from tests.api.conftest import debug_engine

PROMPT = list(b"Once upon a time")


def offline_text(params: SamplingParams) -> list[str]:
    engine = debug_engine()
    assert isinstance(engine.model, torch.nn.Module)
    llm = LLM(engine.model, engine.tokenizer, max_model_len=256, num_pages=256, page_size=8, max_num_seqs=16)
    return [c.text for c in llm.generate([PROMPT], params)[0].outputs]


async def run(frontend: AsyncEngine, params: SamplingParams, request_id: str = "r") -> tuple[dict[int, list[str]], dict[int, str]]:
    pieces: dict[int, list[str]] = {}
    reasons: dict[int, str] = {}
    async for update in frontend.generate(request_id, PROMPT, params):
        assert len(update.prompt_token_ids) == len(PROMPT) and update.num_cached_tokens == 0
        for d in update.outputs:
            pieces.setdefault(d.index, []).append(d.text)
            if d.finish_reason:
                reasons[d.index] = d.finish_reason
    return pieces, reasons


def with_frontend(test):
    async def body(*args):
        frontend = AsyncEngine(debug_engine())
        frontend.start()
        try:
            await test(frontend, *args)
        finally:
            await frontend.shutdown(timeout=5)
        frontend.engine.check_integrity()
        assert frontend.engine.cache.num_free_pages == frontend.engine.cache.num_pages

    return lambda *args: asyncio.run(body(*args))


def test_deltas_add_up_to_the_offline_text(torch_one_thread) -> None:
    params = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=20)
    expected = offline_text(params)

    @with_frontend
    async def check(frontend):
        pieces, reasons = await run(frontend, params)
        assert ["".join(pieces[i]) for i in range(2)] == expected
        assert reasons == {0: "length", 1: "length"}

    check()


def test_stop_string_is_never_half_sent(torch_one_thread) -> None:
    full = offline_text(SamplingParams(temperature=0, max_tokens=30))[0]
    start = next(i for i in range(6, len(full) - 3) if "\ufffd" not in full[i : i + 3])
    stop = full[start : start + 3]
    params = SamplingParams(temperature=0, max_tokens=30, stop=(stop,))

    @with_frontend
    async def check(frontend):
        pieces, reasons = await run(frontend, params)
        sent = ""
        for piece in pieces[0]:
            sent += piece
            assert full[: full.find(stop)].startswith(sent)  # every prefix sent is a prefix of the final text
        assert sent == full[: full.find(stop)] and reasons == {0: "stop"}

    check()


def test_leaving_early_aborts_and_frees(torch_one_thread) -> None:
    @with_frontend
    async def check(frontend):
        gen = frontend.generate("early", PROMPT, SamplingParams(max_tokens=200, ignore_eos=True))
        await gen.__anext__()
        await gen.aclose()
        assert await frontend.call(lambda e: e.has_unfinished()) is False
        await frontend.call(lambda e: e.check_integrity())
        assert frontend.num_active == 0

    check()


def test_bad_prompt_raises_value_error(torch_one_thread) -> None:
    @with_frontend
    async def check(frontend):
        with pytest.raises(ValueError, match="token id 10000: expected ids in"):
            async for _ in frontend.generate("bad", [1, 10_000], SamplingParams()):
                pass
        assert frontend.is_healthy

    check()


def test_shutdown_aborts_in_flight_and_refuses_new(torch_one_thread) -> None:
    async def check():
        frontend = AsyncEngine(debug_engine())
        frontend.start()
        reasons: list[str] = []

        async def consume():
            async for update in frontend.generate("long", PROMPT, SamplingParams(max_tokens=230, ignore_eos=True)):
                reasons.extend(d.finish_reason for d in update.outputs if d.finish_reason)

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.2)
        await frontend.shutdown(timeout=0.05)
        await asyncio.wait_for(task, 5)
        assert reasons == ["abort"]
        with pytest.raises(FrontendClosedError):
            async for _ in frontend.generate("late", PROMPT, SamplingParams()):
                pass
        assert not frontend.is_healthy
        frontend.engine.check_integrity()  # the thread has ended: the engine is ours again
        assert not frontend.engine.has_unfinished()

    asyncio.run(check())


def test_engine_failure_reaches_waiting_requests(torch_one_thread) -> None:
    async def check():
        engine = debug_engine()

        def broken_step():
            raise RuntimeError("injected failure")

        engine.step = broken_step  # type: ignore[method-assign]  # the test swaps in a failing step on purpose
        frontend = AsyncEngine(engine)
        frontend.start()
        with pytest.raises(EngineDeadError, match="injected failure"):
            async for _ in frontend.generate("doomed", PROMPT, SamplingParams()):
                pass
        assert not frontend.is_healthy
        with pytest.raises(EngineDeadError):
            async for _ in frontend.generate("after", PROMPT, SamplingParams()):
                pass
        await frontend.shutdown(timeout=1)

    asyncio.run(check())
