"""AsyncEngine: the single-threaded LLMEngine behind an asyncio API -- the engine loop in a background thread, one queue per request.

Threads: the engine thread alone touches the engine (add, step, abort, inspect). The event loop talks to it only through a
command list under a condition variable (`_submit`), and the engine thread answers through `loop.call_soon_threadsafe` (one
call per step, delivering every request's update). Torch releases the GIL inside kernels, so the event loop keeps serving
HTTP while a step runs.
Per request the engine reports cumulative text; this turns it into deltas. While a request has stop strings, the last
max(len(stop)) - 1 characters are held back, because a stop string completed by a later token cuts text that would otherwise
already have been sent. Leaving `generate` early (client disconnect, cancellation) aborts the request, which frees its pages and
state slot in the engine's next iteration. `shutdown` refuses new requests, waits for in-flight ones up to a timeout, aborts the
rest and checks the engine's integrity before the thread ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from openk3.serve.engine import LLMEngine
from openk3.serve.request import RequestMetrics, RequestOutput, TokenLogprobs
from openk3.serve.sampling import SamplingParams

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop failed; in-flight requests get this, and the server reports itself unhealthy."""


class FrontendClosedError(RuntimeError):
    """The server is shutting down and takes no new requests."""


@dataclass(frozen=True)
class FinishedRequest:
    finish_reason: str
    queue_time: float | None
    time_to_first_token: float | None
    e2e_latency: float | None


@dataclass(frozen=True)
class CompletionDelta:
    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class GenerationUpdate:
    deltas: tuple[CompletionDelta, ...]  # the completions that changed, in index order
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool  # every completion of the request has finished


class EngineObserver(Protocol):
    """What the front end reports as it goes (the server's Prometheus metrics). Called on the engine thread, between steps:
    `observe_engine` may read the engine (stats, cache occupancy) but must not change it."""

    def observe_engine(self, engine: LLMEngine) -> None: ...

    def observe_tokens(self, inter_token_latencies: list[float]) -> None: ...

    def observe_prompt(self, num_prompt_tokens: int, num_cached_tokens: int) -> None: ...

    def observe_finished(self, done: FinishedRequest) -> None: ...


def cached_tokens_of(metrics: RequestMetrics) -> int:
    # Issue 5: the engine reports RequestMetrics.num_cached_tokens once prefix caching lands; until then no prompt token is cached.
    return int(getattr(metrics, "num_cached_tokens", 0))


@dataclass
class _Child:
    text_len: int = 0
    num_tokens: int = 0
    num_logprobs: int = 0
    last_token_time: float | None = None
    finished: bool = False


@dataclass
class _Tracked:
    """A request as the engine thread sees it; created by the add command, dropped when it finishes or is aborted."""

    queue: asyncio.Queue
    n: int
    holdback: int
    children: dict[int, _Child] = field(default_factory=dict)
    prompt_counted: bool = False


class AsyncEngine:
    def __init__(self, engine: LLMEngine, observer: EngineObserver | None = None) -> None:
        self.engine = engine
        self.observer = observer
        self._cv = threading.Condition()
        self._commands: list[Callable[[], None]] = []
        self._stop = False
        self._closed = False
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._active = 0  # generate() calls in progress; event loop only
        self._accepting = True
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # event loop side

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the outputs."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start: already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="openk3-engine", daemon=True)
        self._thread.start()

    @property
    def is_healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive()

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop outputs are delivered to (None before start)."""
        return self._loop

    @property
    def num_active(self) -> int:
        return self._active

    def _submit(self, command: Callable[[], None]) -> None:
        with self._cv:
            if self._closed:
                raise FrontendClosedError("the engine thread has stopped")
            self._commands.append(command)
            self._cv.notify()

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread, between steps, and return its result (e.g. check_integrity)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def command() -> None:
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:  # handed to the caller, not swallowed
                fut.set_exception(e)

        self._submit(command)
        return await asyncio.wrap_future(fut)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncGenerator[GenerationUpdate, None]:
        """Updates for one request until every completion has finished; leaving early aborts it. Raises ValueError on bad input."""
        if self.error is not None:
            raise EngineDeadError(f"the engine loop failed: {self.error!r}")
        if not self._accepting or self._thread is None:
            raise FrontendClosedError("the server is shutting down")
        self._active += 1
        queue: asyncio.Queue = asyncio.Queue()
        added: concurrent.futures.Future = concurrent.futures.Future()
        holdback = max((len(s) for s in params.stop), default=1) - 1
        tracked = _Tracked(queue, params.n, holdback)
        finished = False

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt_token_ids, params)
            except BaseException as e:
                added.set_exception(e)
                return
            tracked.children = {i: _Child() for i in range(params.n)}
            self._tracked[request_id] = tracked
            added.set_result(None)

        try:
            self._submit(add)
            await asyncio.wrap_future(added)
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._active -= 1
            add_failed = added.done() and added.exception() is not None  # then the id is not ours to abort
            if not finished and not add_failed:
                with contextlib.suppress(FrontendClosedError):  # a stopped engine thread has aborted everything already
                    self._submit(lambda: self._abort(request_id, notify=False))

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop taking requests, let in-flight ones finish for up to `timeout` seconds, abort the rest, stop the engine thread."""
        self._accepting = False
        deadline = time.monotonic() + timeout
        while self._active and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    # engine thread side

    def _publish_stats(self) -> None:
        if self.observer is not None:
            self.observer.observe_engine(self.engine)

    def _deliver(self, items: list[tuple[asyncio.Queue, Any]]) -> None:
        if items and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_put_all, items)

    def _abort(self, request_id: str, notify: bool) -> None:
        self.engine.abort(request_id)
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        unfinished = [i for i, c in tracked.children.items() if not c.finished]
        if self.observer is not None:
            for _ in unfinished:
                self.observer.observe_finished(FinishedRequest("abort", None, None, None))
        if not notify:
            return
        deltas = tuple(CompletionDelta(i, "", (), None, "abort") for i in unfinished)
        self._deliver([(tracked.queue, GenerationUpdate(deltas, 0, 0, finished=True))])

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._commands and not self._stop and (self.error is not None or not self.engine.has_unfinished()):
                    self._cv.wait()
                commands, self._commands = self._commands, []
                stop = self._stop
                self._closed = stop  # commands submitted from now on are refused, so none is left unanswered
            try:
                for command in commands:
                    command()
                if stop:
                    self._close()
                    return
                if self.error is None and self.engine.has_unfinished():
                    self._dispatch(self.engine.step())
                self._publish_stats()
            except Exception as e:  # the engine state is now unknown: fail every request, refuse new ones
                self._fail(e)
                if stop:
                    return

    def _close(self) -> None:
        for request_id in list(self._tracked):
            self._abort(request_id, notify=True)
        if self.error is None:
            self.engine.check_integrity()
        self._publish_stats()

    def _fail(self, error: Exception) -> None:
        self.error = error
        dead = EngineDeadError(f"the engine loop failed: {error!r}")
        self._deliver([(t.queue, dead) for t in self._tracked.values()])
        for request_id in list(self._tracked):
            try:
                self.engine.abort(request_id)
            except Exception:  # best effort: the engine is already broken and reported as such
                pass
        self._tracked.clear()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        groups: dict[str, list[RequestOutput]] = {}
        for out in outputs:
            groups.setdefault(out.request_id, []).append(out)
        items: list[tuple[asyncio.Queue, Any]] = []
        itls: list[float] = []
        for request_id, outs in groups.items():
            tracked = self._tracked.get(request_id)
            if tracked is None:
                continue  # aborted while the step ran
            deltas = []
            num_cached = cached_tokens_of(outs[0].metrics[0])
            for out in sorted(outs, key=lambda o: o.outputs[0].index):
                c, m = out.outputs[0], out.metrics[0]
                child = tracked.children[c.index]
                new_tokens = c.token_ids[child.num_tokens :]
                if child.last_token_time is not None and new_tokens:
                    itls.extend([(now - child.last_token_time) / len(new_tokens)] * len(new_tokens))
                child.last_token_time = now
                end = len(c.text) if out.finished else max(child.text_len, len(c.text) - tracked.holdback)
                text = c.text[child.text_len : end]
                logprobs = None if c.logprobs is None else tuple(c.logprobs[child.num_logprobs :])
                child.text_len, child.num_tokens = max(child.text_len, end), len(c.token_ids)
                child.num_logprobs = child.num_logprobs if c.logprobs is None else len(c.logprobs)
                if out.finished:
                    child.finished = True
                    if self.observer is not None:
                        self.observer.observe_finished(FinishedRequest(c.finish_reason or "abort", m.queue_time, m.time_to_first_token, m.e2e_latency))
                deltas.append(CompletionDelta(c.index, text, tuple(new_tokens), logprobs, c.finish_reason, c.stop_reason))
            if not tracked.prompt_counted:
                tracked.prompt_counted = True
                if self.observer is not None:
                    self.observer.observe_prompt(len(outs[0].prompt_token_ids), num_cached)
            done = all(ch.finished for ch in tracked.children.values())
            items.append((tracked.queue, GenerationUpdate(tuple(deltas), len(outs[0].prompt_token_ids), num_cached, done)))
            if done:
                del self._tracked[request_id]
        if self.observer is not None and itls:
            self.observer.observe_tokens(itls)
        self._deliver(items)


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
