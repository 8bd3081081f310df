"""`POST /v1/pty_stream` and `/v1/watch_stream`: a handle's news as NDJSON while it comes (chunked HTTP, no WebSocket).

Lines: `{"item": <PtyOutput | WatchEvent>}` as items come, `{"idle": true}` after a quiet step (so a client's read timeout
measures a dead server, not a quiet terminal), then `{"end": true}` when the terminal or the watch has ended, or
`{"error": {"type", "message"}}` when a step fails after the answer started. Refusals before the first line (unknown handle,
bad offset) are the usual 4xx answer. Typing, resizing and signals stay plain POST calls beside the stream.

Each step is a blocking read of at most service_interactive.STREAM_POLL_S on the long pool, whose slot the stream holds until
it ends; a step with nothing to say yields None (an idle line), and the stream ends after any step once its client has gone. Nothing is buffered
here: a slow client only delays the next read, and what the handle produced meanwhile waits in its own bounded buffer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive

from openk3.sandbox.api import errors
from openk3.sandbox.api.exec_stream import disconnected
from openk3.sandbox.api.pool import WorkerPool
from openk3.sandbox.protocol import to_jsonable

END = object()


def _line(record: dict[str, Any]) -> bytes:
    return json.dumps(record).encode() + b"\n"


def _step(items: Iterator[Any]) -> Any:
    return next(items, END)


def start(method: str, pool: WorkerPool, items: Iterator[Any], receive: Receive) -> StreamingResponse:
    """Stream `items` (made and checked already); the caller holds a slot of `pool`, released when the stream ends."""

    async def lines() -> AsyncIterator[bytes]:
        gone = asyncio.ensure_future(disconnected(receive))
        try:
            while not gone.done():
                try:
                    item = await pool.run(lambda: _step(items))
                except Exception as e:
                    yield _line({"error": errors.record(method, e)})
                    return
                if item is END:
                    yield _line({"end": True})
                    return
                yield _line({"idle": True} if item is None else {"item": to_jsonable(item)})
        finally:
            gone.cancel()
            pool.release()

    return StreamingResponse(lines(), media_type="application/x-ndjson")
