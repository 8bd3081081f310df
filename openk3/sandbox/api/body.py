"""A request body as a blocking reader for a worker thread: archives stream through it chunk by chunk, never held whole."""

from __future__ import annotations

import asyncio

from fastapi import Request

from openk3.sandbox.protocol import InvalidArgument


class Body:
    """The request body as a blocking `read(n)` for a worker thread; each chunk is fetched from the event loop on demand."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop) -> None:
        self._chunks = request.stream().__aiter__()
        self._loop = loop
        self._buf = b""
        self._done = False

    async def _next(self) -> bytes | None:
        try:
            return await self._chunks.__anext__()
        except StopAsyncIteration:
            return None

    def read(self, n: int = -1) -> bytes:
        while not self._buf and not self._done:
            chunk = asyncio.run_coroutine_threadsafe(self._next(), self._loop).result()
            self._done = chunk is None
            self._buf = chunk or b""
        n = len(self._buf) if n < 0 else n
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def read_all(self, limit: int, what: str) -> bytes:
        parts, size = [], 0
        while chunk := self.read():
            size += len(chunk)
            if size > limit:
                raise InvalidArgument(f"{what}: the body is larger than {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)
