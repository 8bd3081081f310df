"""Run one HTTP request through an ASGI app in this process and yield its response as it is sent.

A replica serves the openk3 server's own FastAPI app this way, so the OpenAI API is the one `openk3 serve` has, not a copy.
The body is handed over in one message; after it, `receive` waits until the caller goes away (the generator is closed
or cancelled) and only then reports `http.disconnect`, which the app's handlers race against to abort the request and
free its pages and state slot, as for a client leaving a plain `openk3 serve`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from openk3.scale.calls import ReplicaCall

Message = dict[str, Any]


class ResponseStart:
    def __init__(self, status: int, headers: tuple[tuple[bytes, bytes], ...]) -> None:
        self.status = status
        self.headers = headers


async def asgi_call(app: Any, call: ReplicaCall) -> AsyncIterator[ResponseStart | bytes]:
    """Yields one ResponseStart, then every non-empty body chunk, until the app's response ends."""
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    caller_gone = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": call.body, "more_body": False}
        await caller_gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": call.method,
        "scheme": "http",
        "path": call.path,
        "raw_path": call.path.encode(),
        "query_string": call.query,
        "root_path": "",
        "headers": list(call.headers),
        "client": ("ray-serve-frontend", 0),
        "server": ("openk3-replica", 0),
    }

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await sent.put(None)

    task = asyncio.create_task(run())
    try:
        while True:
            message = await sent.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], tuple((bytes(k), bytes(v)) for k, v in message.get("headers", ())))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        caller_gone.set()  # the response is complete: a handler still watching for a disconnect may stop now
        await task  # the app's own exception, if any, is the caller's to see
    finally:
        caller_gone.set()
        if not task.done():
            # the caller left mid-response: the app sees the disconnect, aborts the request and returns
            await asyncio.wait([task])
