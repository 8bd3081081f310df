"""Graceful shutdown over HTTP: streams in flight when the server stops are finished or aborted, and the engine ends clean."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.api.conftest import start_server, stop_server


@pytest.mark.parametrize("graceful_s, expect_done", [(0.3, False), (20.0, True)], ids=["aborted", "drained"])
def test_stop_with_streams_in_flight(torch_one_thread, graceful_s: float, expect_done: bool) -> None:
    live = start_server(graceful_s=graceful_s)
    lines: list[str] = []
    outcome: list[str] = []

    def client() -> None:
        body = {"model": "debug", "prompt": "stream", "max_tokens": 60 if expect_done else 230, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", live.base_url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
            outcome.append("done" if "data: [DONE]" in lines else "cut")
        except httpx.HTTPError:
            outcome.append("cut")

    thread = threading.Thread(target=client)
    thread.start()
    deadline = time.monotonic() + 30
    while len(lines) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    stop_server(live)
    thread.join(timeout=30)
    assert outcome == (["done"] if expect_done else ["cut"])
    engine = live.frontend.engine  # the engine thread has ended: the engine is ours to inspect
    assert live.frontend.error is None
    engine.check_integrity()
    assert not engine.has_unfinished() and engine.cache.num_free_pages == engine.cache.num_pages
