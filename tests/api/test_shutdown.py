"""Graceful shutdown over HTTP: streams in flight when the server stops are finished or aborted, and the engine ends clean."""

from __future__ import annotations

import threading
import time

import httpx

from tests.api.conftest import GatedStep, start_server, stop_server


def _check_clean(live) -> None:
    engine = live.frontend.engine  # the engine thread has ended: the engine is ours to inspect
    assert live.frontend.error is None
    engine.check_integrity()
    assert not engine.has_unfinished() and engine.cache.num_free_pages == engine.cache.num_pages


def test_stop_with_streams_in_flight_drained(torch_one_thread) -> None:
    live = start_server(graceful_s=20.0)
    lines: list[str] = []
    outcome: list[str] = []

    def client() -> None:
        body = {"model": "debug", "prompt": "stream", "max_tokens": 60, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", live.base_url + "/v1/completions", json=body, timeout=60) as r:
            lines.extend(r.iter_lines())
        outcome.append("done" if "data: [DONE]" in lines else "cut")

    thread = threading.Thread(target=client)
    thread.start()
    deadline = time.monotonic() + 30
    while len(lines) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    stop_server(live)  # the stream has 20 s to finish its 60 tokens: it drains
    thread.join(timeout=30)
    assert outcome == ["done"]
    _check_clean(live)


def test_stop_with_streams_in_flight_aborted(torch_one_thread) -> None:
    """The engine is held inside a step while the server stops, so the stream cannot finish within the grace period
    whatever the machine's speed; the client lets the engine go on once it has seen the stream cut."""
    gates: list[GatedStep] = []
    live = start_server(graceful_s=0.3, before_start=lambda e: gates.append(GatedStep(e)))
    gate = gates[0]
    started = threading.Event()
    outcome: list[str] = []

    def client() -> None:
        body = {"model": "debug", "prompt": "stream", "max_tokens": 230, "ignore_eos": True, "stream": True}
        lines: list[str] = []
        try:
            with httpx.stream("POST", live.base_url + "/v1/completions", json=body, timeout=60) as r:
                started.set()
                lines.extend(r.iter_lines())
            outcome.append("done" if "data: [DONE]" in lines else "cut")
        except httpx.HTTPError:
            outcome.append("cut")
        finally:
            started.set()
            gate.release.set()  # only now may the engine go on: the abort and the shutdown queue behind the held step

    thread = threading.Thread(target=client)
    thread.start()
    assert started.wait(30) and gate.entered.wait(30)
    stop_server(live)
    thread.join(timeout=30)
    assert outcome == ["cut"]
    _check_clean(live)
