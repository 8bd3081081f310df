"""The front end's failure latch: once the engine is dead, every caller is answered at once, whoever is stuck.

A multi-rank engine fails in one of two places: inside a step (the engine thread raises) or outside it (the rank heartbeat,
parallel/serving/heartbeat.py, sees a rank stop answering while the engine thread still waits in a collective that would
time out only minutes later). Either way nobody may be left waiting: the streams already open, the adds still queued
behind the stuck step, and every add from then on. The engine thread cannot deliver those answers (it may be the thread
that is stuck), so the latch delivers them on the event loop: the first `trip`, from any thread, records the error and
schedules one callback there that puts an EngineDeadError into every open stream's queue and wakes every pending add.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, TypeVar

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop failed; in-flight requests get this, and the server reports itself unhealthy."""


class EngineStalledError(RuntimeError):
    """The engine's current step has run past `step_timeout_s`: a new request would only wait behind it, so it is refused."""


class FailureLatch:
    """The first failure of one engine. `trip` and `error` from any thread; the rest on the event loop given to `bind`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: asyncio.Event | None = None  # set on the loop once the open streams have been answered
        self._queues: set[asyncio.Queue] = set()  # event loop only: the open streams, answered when the latch trips

    @property
    def error(self) -> BaseException | None:
        return self._error

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Call on `loop` (the front end's start)."""
        self._loop = loop
        self._dead = asyncio.Event()

    def dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"the engine loop failed: {self._error!r}")

    def trip(self, error: BaseException) -> bool:
        """Record `error` (any thread); True for the first call, which alone answers the callers, False after."""
        with self._lock:
            if self._error is not None:
                return False
            self._error = error
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._answer_all)
        return True

    def watch(self, queue: asyncio.Queue) -> None:
        """An open stream's queue, to be answered if the latch trips (event loop)."""
        if self._error is not None:
            queue.put_nowait(self.dead_error())
        else:
            self._queues.add(queue)

    def unwatch(self, queue: asyncio.Queue) -> None:
        self._queues.discard(queue)

    async def answer(self, fut: concurrent.futures.Future[T]) -> T:
        """The engine thread's answer to `fut`, or EngineDeadError as soon as the latch trips (then `fut` is cancelled if it
        has not started: the engine thread skips it; one already running is the caller's to undo)."""
        assert self._dead is not None, "FailureLatch.answer before bind"
        answer: asyncio.Future[T] = asyncio.wrap_future(fut)
        dead: asyncio.Future[Any] = asyncio.ensure_future(self._dead.wait())
        racing: list[asyncio.Future[Any]] = [answer, dead]
        try:
            await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
        finally:
            dead.cancel()
        if answer.done():
            return answer.result()
        answer.cancel()
        raise self.dead_error()

    def _answer_all(self) -> None:
        assert self._dead is not None
        self._dead.set()
        error = self.dead_error()
        for queue in self._queues:
            queue.put_nowait(error)
        self._queues.clear()
