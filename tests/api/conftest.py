"""A live server on 127.0.0.1 (uvicorn in a thread) over the debug model, shared by a test module."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import torch
import uvicorn

from openk3.api.chat import ChatTemplate
from openk3.api.served_model import ModelIdentity
from openk3.api.server import ServerConfig, create_app
from openk3.launch.engine import build_engine
from openk3.launch.spec import EngineSpec
from openk3.serve.async_engine import AsyncEngine
from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.tokenizer import Tokenizer

MAX_MODEL_LEN = 256
NUM_PAGES = 256
PAGE_SIZE = 8
MAX_NUM_SEQS = 16


def debug_engine(**overrides: Any) -> LLMEngine:
    """The debug preset's engine, built as the server builds one (build_engine: the model in its serving layout)."""
    cfg: dict[str, Any] = dict(max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, num_pages=NUM_PAGES, page_size=PAGE_SIZE, max_num_batched_tokens=512)
    cfg.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_engine(EngineSpec("debug", EngineConfig(**cfg))).local


@dataclass
class LiveServer:
    base_url: str
    server: uvicorn.Server
    thread: threading.Thread
    frontend: AsyncEngine
    app: object

    def in_loop(self, coro, timeout: float = 30.0):
        """Run a coroutine on the server's event loop (where the front end lives) and return its result."""
        assert self.frontend.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.frontend.loop).result(timeout)

    def check_idle_and_free(self, timeout: float = 10.0) -> None:
        """Wait until the engine has nothing left, then assert every page and slot is free and the integrity checks hold."""
        deadline = time.monotonic() + timeout
        while self.in_loop(self.frontend.call(lambda e: e.has_unfinished())) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.in_loop(self.frontend.call(lambda e: e.check_integrity()))
        free = self.in_loop(self.frontend.call(lambda e: (e.cache.num_free_pages, e.cache.num_free_slots)))
        assert free == (NUM_PAGES, MAX_NUM_SEQS)


def metric(text: str, name: str) -> float:
    """The value of one `openk3:` sample (with labels) in Prometheus text."""
    match = re.search(rf"^openk3:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert match, name
    return float(match.group(1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    api_key: str | None = None,
    max_body_bytes: int = 2**20,
    graceful_s: float = 5,
    tokenizer: Tokenizer | None = None,
    before_start: Callable[[LLMEngine], None] | None = None,
    server: dict[str, Any] | None = None,
    **engine_overrides,
) -> LiveServer:
    """`tokenizer`: the server's (default: the engine's); `before_start`: called with the engine before the engine thread
    exists (to swap in a fake step); `server`: more ServerConfig fields (frontend, limits, ...)."""
    engine = debug_engine(**engine_overrides)
    if before_start is not None:
        before_start(engine)
    config = ServerConfig(ModelIdentity("debug", "debug"), api_key=api_key, max_body_bytes=max_body_bytes, shutdown_timeout_s=graceful_s, **(server or {}))
    app = create_app(engine, tokenizer or engine.tokenizer, ChatTemplate.default(), config)
    # uvicorn annotates an int, but hands the value to asyncio.wait_for, which takes the fractions of a second tests use
    return serve_app(app, timeout_graceful_shutdown=graceful_s, **config.connection.uvicorn_options())  # type: ignore[arg-type]


def serve_app(app: Any, startup_s: float = 30, **uvicorn_options: Any) -> LiveServer:
    """`app` served by uvicorn on a free loopback port in a background thread, once it has started (`startup_s` bounds a
    hang; the wait itself is on uvicorn's own `started` flag)."""
    port = _free_port()
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **uvicorn_options))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_s
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return LiveServer(f"http://127.0.0.1:{port}", uv, thread, app.state.served.frontend, app)


class GatedStep:
    """A fake slow engine step: the real step, then -- on the first call -- it signals `entered` and waits for `release`.
    Threading events, because the step runs on the engine thread, which has no event loop. Requests submitted while it
    waits queue up behind it in their order, so a test can force "queued behind a running step" without timing anything."""

    def __init__(self, engine: LLMEngine, before: bool = False) -> None:
        self.step = engine.step
        self.before = before  # hold before the real step (nothing of this step is scheduled yet) rather than after
        self.entered = threading.Event()
        self.release = threading.Event()
        engine.step = self  # type: ignore[method-assign]  # the test holds the step on purpose

    def __call__(self):
        out = None if self.before else self.step()
        self.entered.set()
        self.release.wait()
        return self.step() if self.before else out


def stop_server(live: LiveServer) -> None:
    live.server.should_exit = True
    live.thread.join(timeout=30)
    assert not live.thread.is_alive(), "the server did not shut down"
    assert not live.frontend.is_healthy  # the engine thread ended with the lifespan


@pytest.fixture(scope="module")
def torch_one_thread() -> Iterator[None]:
    # The engine's small matmuls run fastest single-threaded on shared CPUs; restore the caller's setting afterwards.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def live(torch_one_thread) -> Iterator[LiveServer]:
    server = start_server()
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.base_url, timeout=60) as client:
        yield client
