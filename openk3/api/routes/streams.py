"""Responses that notice a client going away: an SSE stream that stops (and aborts its request) at `http.disconnect`, and a
race of a non-streaming generation against it, so the engine frees the request's pages and state slot at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class EventStreamResponse(StreamingResponse):
    """SSE that stops (and aborts its request) as soon as the client disconnects, not at the next failed send."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]) -> None:
        """`on_close` releases what the events would have released (the engine requests) when they never start: a
        generator closed before its first step runs no `finally`."""
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        streamer, watcher = asyncio.ensure_future(self.stream_response(send)), asyncio.ensure_future(watch())
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streamer, watcher):
                task.cancel()
            await asyncio.gather(streamer, watcher, return_exceptions=True)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            await self.on_close()


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """work's result, or None when the client went away first (work is then cancelled, which aborts its engine requests)."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    worker, watcher = asyncio.ensure_future(work), asyncio.ensure_future(watch())
    try:
        await asyncio.wait({worker, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (worker, watcher):
            if not task.done():
                task.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if worker.cancelled() or not worker.done():
        await asyncio.gather(worker, return_exceptions=True)
        return None
    return worker.result()
