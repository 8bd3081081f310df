"""Admission control: a bounded waiting queue (503 + Retry-After beyond it), a queue timeout, and the per-request limits (n,
stop strings, stop_token_ids) stated in the 400. Orders are forced with a held engine step and a clock that counts steps,
never timed."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from openk3.api.errors import frontend_error
from openk3.api.limits import RequestLimits
from openk3.serve.admission import QueueFullError, QueueTimeoutError
from openk3.serve.async_engine import AsyncEngine
from openk3.serve.config import FrontendConfig
from openk3.serve.sampling import SamplingParams
from tests.api.conftest import GatedStep, debug_engine, start_server, stop_server

PROMPT = list(b"Once upon a time")
LONG = SamplingParams(max_tokens=40, ignore_eos=True)


WAITING = [("b", "flood"), ("c", "flood"), ("d", "flood"), ("p", "probe")]


def test_fair_full_queue_sheds_the_flooding_clients_newest_request(torch_one_thread) -> None:
    """Under the fair policy a full queue still takes another client's request: the flooding client's newest waiting request
    ends with QueueFullError in its place; the flooding client's own next request is refused as under fcfs."""

    def params(client: str, n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, ignore_eos=True, client=client)

    async def check() -> None:
        engine = debug_engine(max_num_seqs=1, scheduling_policy="fair")  # "a" runs, the rest wait
        gate = GatedStep(engine)
        frontend = AsyncEngine(engine, config=FrontendConfig(max_waiting_requests=2))
        frontend.start()
        try:
            a = await frontend.add("a", PROMPT, params("flood", 8))
            await asyncio.to_thread(gate.entered.wait)
            adds = [asyncio.ensure_future(frontend.add(name, PROMPT, params(client, 2))) for name, client in WAITING]
            while frontend.num_active < 1 + len(adds):  # every add submitted, in this order, behind the held step
                await asyncio.sleep(0)
            gate.release.set()
            b, c = await adds[0], await adds[1]
            with pytest.raises(QueueFullError, match="2 requests are already waiting"):
                await adds[2]  # the flood's own next request: refused
            p = await adds[3]  # another client's: c makes room for it
            with pytest.raises(QueueFullError, match="made room for another client's"):
                [u async for u in c]
            for stream in (a, b, p):
                assert [u async for u in stream][-1].finished
            assert frontend.num_active == 0 and frontend.is_healthy
        finally:
            gate.release.set()
            await frontend.shutdown(timeout=5)
        engine.check_integrity()

    asyncio.run(asyncio.wait_for(check(), 120))  # a bound on a hang, not a race


def test_full_queue_refuses_the_next_request(torch_one_thread) -> None:
    async def check() -> None:
        engine = debug_engine(max_num_seqs=1)  # "a" runs, "b" waits
        gate = GatedStep(engine)  # held after the step that scheduled "a"
        frontend = AsyncEngine(engine, config=FrontendConfig(max_waiting_requests=1))
        frontend.start()
        try:
            a = await frontend.add("a", PROMPT, LONG)
            await asyncio.to_thread(gate.entered.wait)
            b_add = asyncio.ensure_future(frontend.add("b", PROMPT, SamplingParams(max_tokens=2, ignore_eos=True)))
            c_add = asyncio.ensure_future(frontend.add("c", PROMPT, SamplingParams(max_tokens=2)))
            while frontend.num_active < 3:  # both adds submitted, in this order, behind the held step
                await asyncio.sleep(0)
            gate.release.set()
            b = await b_add
            with pytest.raises(QueueFullError, match="1 requests are already waiting"):
                await c_add
            outs = [u async for u in a] + [u async for u in b]
            assert [o.request_id for o in outs if o.finished] == ["a", "b"]
            assert frontend.num_active == 0 and frontend.is_healthy
            d = await frontend.add("d", PROMPT, SamplingParams(max_tokens=2))  # the queue has room again
            assert [u async for u in d][-1].finished
        finally:
            gate.release.set()
            await frontend.shutdown(timeout=5)
        engine.check_integrity()

    asyncio.run(check())


def test_queue_timeout_aborts_a_request_that_waits_too_long(torch_one_thread) -> None:
    async def check() -> None:
        engine = debug_engine(max_num_seqs=1)
        steps = [0]
        real_step = engine.step

        def counted_step():
            steps[0] += 1
            return real_step()

        engine.step = counted_step  # type: ignore[method-assign]
        # the clock reads engine steps: "b" times out on the third step after its add, while "a" has 40 tokens to go
        frontend = AsyncEngine(engine, config=FrontendConfig(queue_timeout_s=2.5), clock=lambda: float(steps[0]))
        frontend.start()
        try:
            a = await frontend.add("a", PROMPT, LONG)
            first = await a.__anext__()
            assert not first.finished
            b = await frontend.add("b", PROMPT, SamplingParams(max_tokens=2))
            with pytest.raises(QueueTimeoutError, match="longer than the limit of 2.5 s"):
                async for _ in b:
                    pass
            assert await frontend.call(lambda e: "b" in e.scheduler.requests) is False
            assert [u async for u in a][-1].outputs[0].finish_reason == "length"
            assert frontend.is_healthy and frontend.num_active == 0
        finally:
            await frontend.shutdown(timeout=5)
        engine.check_integrity()

    asyncio.run(check())


def test_queue_errors_are_503_with_retry_after() -> None:
    for error, code in ((QueueFullError("full"), "queue_full"), (QueueTimeoutError("late"), "queue_timeout")):
        api = frontend_error(error)
        assert api is not None and api.status == 503 and api.code == code and api.headers == {"Retry-After": "1"}
        assert api.body()["error"]["type"] == "service_unavailable_error"


def test_full_queue_over_http(torch_one_thread) -> None:
    gates: list[GatedStep] = []
    live = start_server(max_num_seqs=1, before_start=lambda e: gates.append(GatedStep(e)), server={"frontend": FrontendConfig(max_waiting_requests=1)})
    gate = gates[0]
    results: dict[str, httpx.Response] = {}

    def post(name: str, max_tokens: int) -> None:
        body = {"model": "debug", "prompt": name, "max_tokens": max_tokens, "ignore_eos": True}
        results[name] = httpx.post(live.base_url + "/v1/completions", json=body, timeout=60)

    try:
        threads = []
        for name, want_active in (("a", None), ("b", 2), ("c", 3)):
            t = threading.Thread(target=post, args=(name, 20 if name == "a" else 2))
            t.start()
            threads.append(t)
            if want_active is None:
                gate.entered.wait(30)  # "a" is running and the engine is held
            else:
                deadline = time.monotonic() + 30  # a bound on a hang, not a race: the order is the queue's
                while live.frontend.num_active < want_active and time.monotonic() < deadline:
                    time.sleep(0.005)
        gate.release.set()
        for t in threads:
            t.join(60)
        assert results["a"].status_code == 200 and results["b"].status_code == 200
        c = results["c"]
        assert c.status_code == 503 and c.headers["retry-after"] == "1"
        assert c.json()["error"]["code"] == "queue_full" and "waiting" in c.json()["error"]["message"]
        assert live.in_loop(live.frontend.call(lambda e: (e.has_unfinished(), e.cache.num_free_slots))) == (False, 1)
    finally:
        gate.release.set()
        stop_server(live)


@pytest.mark.parametrize(
    "field, value, limit, flag",
    [
        ("n", 17, "16 samples", "--max-n"),
        ("stop", [str(i) for i in range(17)], "limit of 16", "--max-stop-strings"),
        ("stop", "x" * 257, "limit of 256", "--max-stop-string-length"),
        ("stop_token_ids", list(range(65)), "limit of 64", "--max-stop-token-ids"),
    ],
)
def test_request_limits_are_400s_that_state_the_limit(live, http: httpx.Client, field: str, value, limit: str, flag: str) -> None:
    for route, base in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = http.post(route, json={"model": "debug", **base, field: value, "max_tokens": 2})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == field and error["code"] == "limit_exceeded" and limit in error["message"] and flag in error["message"]


def test_request_limits_are_settings() -> None:
    assert RequestLimits(max_n=4).max_n == 4
    with pytest.raises(ValueError, match="RequestLimits.max_n=129 is invalid"):
        RequestLimits(max_n=129)
    with pytest.raises(ValueError, match="FrontendConfig.max_waiting_requests=0 is invalid"):
        FrontendConfig(max_waiting_requests=0)


def test_the_limits_are_serve_flags() -> None:
    from openk3.api.server_flags import server_settings
    from openk3.cli import build_parser

    args = build_parser().parse_args(["serve", "--max-waiting-requests", "3", "--queue-timeout-s", "2.5", "--max-n", "2", "--max-stop-token-ids", "0"])
    frontend, limits = server_settings(args)
    assert frontend == FrontendConfig(max_waiting_requests=3, queue_timeout_s=2.5)
    assert limits == RequestLimits(max_n=2, max_stop_token_ids=0)
