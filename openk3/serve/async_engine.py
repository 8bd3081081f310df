"""AsyncEngine: the single-threaded LLMEngine behind an asyncio API -- the engine loop in a background thread, one queue per request.

Threads: the engine thread alone touches the engine (add, step, abort, inspect). The event loop talks to it only through a
command list under a condition variable (`_submit`), and the engine thread answers through `loop.call_soon_threadsafe` (one
call per step, delivering every request's update). Torch releases the GIL inside kernels, so the event loop keeps serving
HTTP while a step runs.
The engine thread runs the engine core and its OutputProcessor (serve/output.py) together: each step's outputs come out of
the processor as RequestOutputs of the kind the caller asked for (DELTA for streams, with the stop-string hold-back applied
there, once; FINAL_ONLY for whole responses) and go to the requests' queues as they are; the step's IterationStats go to the
observer. Leaving a request's stream early (client disconnect, cancellation) aborts the request, which frees its pages and
state slot in the engine's next iteration; a caller that leaves while its add is still queued behind a running step has
nothing added at all (futures the event loop may have cancelled are claimed with `set_running_or_notify_cancel` before
any work, so the engine thread never answers a cancelled one). `shutdown` refuses new requests, waits for in-flight ones
up to a timeout, aborts the rest and checks the engine's integrity before the thread ends.
Failure (serve/engine_failure.py): once the engine has failed -- its step raised, or `fail` was called from outside, as the
rank heartbeat does while the engine thread is still stuck in a collective -- every open stream, every add still queued
and every later add get EngineDeadError at once; while a step runs past `step_timeout_s` new adds get EngineStalledError.
Admission (serve/admission.py, on the engine thread): an add is refused while `max_waiting_requests` requests wait
unscheduled (QueueFullError; under the fair policy it may instead take a flooding client's newest waiting request's place,
which ends with that error), and after each step those that have waited longer than `queue_timeout_s` are aborted
(QueueTimeoutError, delivered to their streams).
Pause (`call_idle`, for weight updates): new adds wait at a gate on the event loop; the requests in flight either run to
their end on the engine as it is (drain) or are aborted (their streams end with finish_reason "abort"); once the engine
has no request, fn(engine) runs on the engine thread, then the gate opens again. A request therefore runs on one weight
version from its first step to its last; its stream says which (`RequestStream.weight_version`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, Generic, Protocol, TypeVar

from openk3.serve.admission import Admission
from openk3.serve.config import FrontendConfig
from openk3.serve.engine_api import ServedEngine
from openk3.serve.engine_failure import EngineDeadError, EngineStalledError, FailureLatch
from openk3.serve.media_prompt import ImageSpan
from openk3.serve.output import FinishedRequest, IterationStats, OutputKind, OutputProcessor, RequestOutput
from openk3.serve.sampling import SamplingParams

T = TypeVar("T")
E = TypeVar("E", bound=ServedEngine)  # LLMEngine, or a DataParallelEngine behind `openk3 serve --dp`
DEAD_THREAD_JOIN_S = 1.0  # how long `shutdown` waits for a dead engine's thread (see there)


__all__ = ["AsyncEngine", "EngineDeadError", "EngineStalledError", "EngineObserver", "FrontendClosedError", "RequestStream"]


class FrontendClosedError(RuntimeError):
    """The server is shutting down and takes no new requests."""


class EngineObserver(Protocol):
    """What the front end reports as it goes (the server's Prometheus metrics). Called on the engine thread, between steps:
    `observe_engine` may read the engine (stats, cache occupancy) but must not change it."""

    def observe_engine(self, engine: ServedEngine) -> None: ...

    def observe_tokens(self, inter_token_latencies: list[float]) -> None: ...

    def observe_first_tokens(self, first_token_latencies: list[float]) -> None: ...

    def observe_prompt(self, num_prompt_tokens: int, num_cached_tokens: int) -> None: ...

    def observe_finished(self, done: FinishedRequest) -> None: ...


class RequestStream:
    """The outputs of one added request, until every sample has finished; `aclose` before that aborts it. Event loop only."""

    def __init__(self, frontend: AsyncEngine, request_id: str, queue: asyncio.Queue, weight_version: int = 0) -> None:
        self.request_id = request_id
        self.weight_version = weight_version  # the engine's weights this request runs on, from its first step to its last
        self._frontend = frontend
        self._queue = queue
        self._open = True

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._open:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):  # the engine thread has already dropped the request (failure, queue timeout)
            self._release(abort=False)
            raise item
        if item.finished:
            self._release(abort=False)
        return item

    async def aclose(self) -> None:
        self._release(abort=True)

    def _release(self, abort: bool) -> None:
        if not self._open:
            return
        self._open = False
        self._frontend._active -= 1
        self._frontend.failure.unwatch(self._queue)
        if abort:
            self._frontend._abort_soon(self.request_id)


class AsyncEngine(Generic[E]):
    def __init__(
        self, engine: E, observer: EngineObserver | None = None, config: FrontendConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.engine = engine
        self.processor = OutputProcessor(engine)  # engine thread only, like the engine
        self.observer = observer
        self.config = config or FrontendConfig()
        self.admission = Admission(engine, self.processor, self.config, clock)  # engine thread only
        self._clock = clock
        self._step_started: float | None = None  # written by the engine thread around each step, read by /health
        # called on the engine thread once the loop has failed (the server's entry point stops the process with it)
        self.on_failure: Callable[[BaseException], None] | None = None
        self._cv = threading.Condition()
        self._commands: list[Callable[[], None]] = []
        self._idle_commands: list[Callable[[], None]] = []  # run once the engine has no request (call_idle)
        self._open = asyncio.Event()  # cleared while call_idle holds new adds back
        self._open.set()
        self._pausing = asyncio.Lock()  # one call_idle at a time
        self._stop = False
        self._closed = False
        self._queues: dict[str, asyncio.Queue] = {}  # engine thread only: the requests in flight
        self._active = 0  # requests added or being added and not yet closed; event loop only
        self._accepting = True
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.failure = FailureLatch()

    @property
    def error(self) -> BaseException | None:
        """Why the engine is dead (None while it is not); any thread."""
        return self.failure.error

    def fail(self, error: BaseException) -> None:
        """Declare the engine dead from outside the engine thread (any thread; the rank heartbeat calls it when a rank stops
        answering): every caller is answered now, new adds are refused, and `on_failure` runs once, on the calling thread.
        The engine thread, when its step returns or raises, drops the requests it still holds and runs no more steps."""
        if self.failure.trip(error) and self.on_failure is not None:
            self.on_failure(error)
        with self._cv:
            self._cv.notify()

    # event loop side

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the outputs."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start: already started")
        self._loop = asyncio.get_running_loop()
        self.failure.bind(self._loop)
        self._thread = threading.Thread(target=self._run, name="openk3-engine", daemon=True)
        self._thread.start()

    @property
    def is_healthy(self) -> bool:
        return self.error is None and self._thread is not None and self._thread.is_alive() and self.stalled_for() is None

    def stalled_for(self) -> float | None:
        """Seconds the current step has run, when that is longer than `step_timeout_s` (a stalled device or rank); else None."""
        started = self._step_started
        if started is None:
            return None
        running = self._clock() - started
        return running if running > self.config.step_timeout_s else None

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

    def _abort_soon(self, request_id: str) -> None:
        try:
            self._submit(lambda: self._abort(request_id, notify=False))
        except FrontendClosedError:
            pass  # a stopped engine thread has aborted everything already

    async def call(self, fn: Callable[[E], T]) -> T:
        """Run fn(engine) on the engine thread, between steps, and return its result (e.g. check_integrity)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def command() -> None:
            if not fut.set_running_or_notify_cancel():
                return  # the caller was cancelled while this waited: fn is not run, and nobody waits for an answer
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:  # handed to the caller, not swallowed
                fut.set_exception(e)

        self._submit(command)
        return await self.failure.answer(fut)

    async def add(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, kind: OutputKind = OutputKind.DELTA, images: tuple[ImageSpan, ...] = ()
    ) -> RequestStream:
        """Add a request and return its output stream (DELTA: one output per step that changed it; FINAL_ONLY: one at the
        end). Raises ValueError on bad input, QueueFullError, EngineDeadError or FrontendClosedError before anything is
        added; a caller cancelled meanwhile leaves nothing behind. While `call_idle` runs, waits for it first."""
        await self._open.wait()
        if self.error is not None:
            raise self.failure.dead_error()
        if not self._accepting or self._thread is None:
            raise FrontendClosedError("the server is shutting down")
        stalled = self.stalled_for()
        if stalled is not None:
            raise EngineStalledError(f"the engine's current step has run for {stalled:.0f} s, longer than step_timeout_s {self.config.step_timeout_s:g}")
        queue: asyncio.Queue = asyncio.Queue()
        added: concurrent.futures.Future[int] = concurrent.futures.Future()

        def add() -> None:
            if not added.set_running_or_notify_cancel():
                return  # the caller left while this waited behind a step: add nothing (and answer no cancelled future)
            try:
                if self.error is not None:  # queued behind the step that failed: nothing may enter a dead engine
                    raise self.failure.dead_error()
                self._admit(request_id, prompt_token_ids, params, kind, images)
            except BaseException as e:
                added.set_exception(e)
                return
            self._queues[request_id] = queue
            added.set_result(self.engine.weight_version)

        self._active += 1
        try:
            self._submit(add)
            weight_version = await self.failure.answer(added)
        except (asyncio.CancelledError, EngineDeadError):
            self._active -= 1
            refused = added.done() and not added.cancelled() and added.exception() is not None
            if not added.cancel() and not refused:  # too late to withdraw: the add ran (or is running), so the abort goes in behind it
                self._abort_soon(request_id)
            raise
        except BaseException:
            self._active -= 1
            raise
        self.failure.watch(queue)
        return RequestStream(self, request_id, queue, weight_version)

    async def call_idle(self, fn: Callable[[E], T], abort_running: bool = False) -> T:
        """Pause, then run fn(engine) on the engine thread once no request runs, and resume (module docstring): the requests
        in flight finish first, or with `abort_running` are aborted now; adds made meanwhile wait and run after fn."""
        async with self._pausing:
            self._open.clear()
            try:
                fut: concurrent.futures.Future[T] = concurrent.futures.Future()

                def command() -> None:
                    if not fut.set_running_or_notify_cancel():
                        return
                    try:
                        fut.set_result(fn(self.engine))
                    except BaseException as e:  # handed to the caller, not swallowed
                        fut.set_exception(e)

                def pause() -> None:
                    if abort_running:
                        for request_id in list(self._queues):
                            self._abort(request_id, notify=True)
                    self._idle_commands.append(command)

                self._submit(pause)
                return await self.failure.answer(fut)
            finally:
                self._open.set()

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, kind: OutputKind = OutputKind.DELTA
    ) -> AsyncGenerator[RequestOutput, None]:
        """`add`, then its outputs until every sample has finished; leaving early aborts the request."""
        stream = await self.add(request_id, prompt_token_ids, params, kind)
        try:
            async for item in stream:
                yield item
        finally:
            await stream.aclose()

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
            # a dead engine's thread may be stuck in a collective with a lost rank, which returns only at the group's timeout
            # (minutes): it is a daemon, so give it a moment to end (it does at once when its step raised) and leave it behind
            await asyncio.to_thread(self._thread.join, min(timeout, DEAD_THREAD_JOIN_S) if self.error is not None else None)

    # engine thread side

    def _publish_stats(self) -> None:
        if self.observer is not None:
            self.observer.observe_engine(self.engine)

    def _deliver(self, items: list[tuple[asyncio.Queue, Any]]) -> None:
        if items and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_put_all, items)

    def _abort(self, request_id: str, notify: bool, error: BaseException | None = None) -> None:
        """Abort; with `notify` the stream gets the last output, with `error` it gets that instead."""
        stats = IterationStats()
        last = self.processor.abort(request_id, stats)
        queue = self._queues.pop(request_id, None)
        self._observe(stats)
        item = error if error is not None else last if notify else None
        if item is not None and queue is not None:
            self._deliver([(queue, item)])

    def _admit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, kind: OutputKind, images: tuple[ImageSpan, ...] = ()) -> None:
        shed = self.admission.check_room(request_id, params.client)
        added = self.processor.add_request(request_id, prompt_token_ids, params, kind, images=images)
        self.admission.arrived(request_id, added, params.client)
        for victim, error in shed:  # only once the new request is in: a refused add sheds nothing
            self._abort(victim, notify=False, error=error)

    def _observe(self, stats: IterationStats) -> None:
        if self.observer is None:
            return
        if stats.inter_token_latencies:
            self.observer.observe_tokens(stats.inter_token_latencies)
        if stats.first_token_latencies:
            self.observer.observe_first_tokens(stats.first_token_latencies)
        for num_prompt, num_cached in stats.prompts:
            self.observer.observe_prompt(num_prompt, num_cached)
        for done in stats.finished:
            self.observer.observe_finished(done)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._commands and not self._stop and not self._idle_due() and (self.error is not None or not self.engine.has_unfinished()):
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
                if self._idle_due():
                    idle, self._idle_commands = self._idle_commands, []
                    for command in idle:
                        command()
                if self.error is None and self.engine.has_unfinished():
                    stats = IterationStats()
                    self._step_started = self._clock()
                    try:
                        core_outputs = self.engine.step()
                    finally:
                        self._step_started = None
                    self._dispatch(self.processor.process(core_outputs, stats))
                    self._observe(stats)
                    for request_id, error in self.admission.expired():
                        self._abort(request_id, notify=False, error=error)
                if self.error is not None and self._queues:  # failed from outside (`fail`) while the step ran
                    self._fail(self.error)
                self._publish_stats()
            except Exception as e:  # the engine state is now unknown: fail every request, refuse new ones
                self._fail(e)
                if stop:
                    return

    def _idle_due(self) -> bool:
        return bool(self._idle_commands) and self.error is None and not self.engine.has_unfinished()

    def _close(self) -> None:
        for request_id in list(self._queues):
            self._abort(request_id, notify=True)
        idle, self._idle_commands = self._idle_commands, []
        for command in idle:  # the engine is idle now: a pending call_idle is answered, not left waiting
            command()
        if self.error is None:
            self.engine.check_integrity()
        self._publish_stats()

    def _fail(self, error: BaseException) -> None:
        """Engine thread: trip the latch (its first trip answers every caller) and drop every request the engine holds."""
        first = self.failure.trip(error)
        for request_id in list(self._queues):
            try:
                self.processor.abort(request_id)
            except Exception:  # best effort: the engine is already broken and reported as such
                pass
        self._queues.clear()
        self.admission.clear()
        if first and self.on_failure is not None:
            self.on_failure(error)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        items: list[tuple[asyncio.Queue, Any]] = []
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is None:
                continue  # aborted while the step ran
            items.append((queue, out))
            if out.finished:
                del self._queues[out.request_id]
        self._deliver(items)


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
