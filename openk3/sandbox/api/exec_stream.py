"""`POST /v1/exec_stream`: a command's output while it runs, as NDJSON (one JSON object per line, sent as it is read).

Lines: `{"stream": "stdout" | "stderr", "b64": <chunk>}` as output arrives, then one `{"result": <ExecResult>}` (its stdout and
stderr empty: they were streamed), or `{"error": {"type", "message"}}` when the command fails after the answer started.
Errors found before it starts (bad arguments, unknown sandbox) are the usual 4xx JSON answer instead.

The command runs on a worker thread of the long pool and hands each chunk to the event loop through a bounded queue: a
client that reads slowly slows the command (it blocks on its pipe), never grows the daemon's memory. A client that goes away
sets `stop`, which kills the command's whole tree, as a deadline would.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive

from openk3.sandbox.api import errors
from openk3.sandbox.api.pool import WorkerPool
from openk3.sandbox.api.service import SandboxService
from openk3.sandbox.api.tenant_view import TenantView
from openk3.sandbox.protocol import to_jsonable

QUEUE_CHUNKS = 16  # chunks of at most 64 KiB waiting for the client


def exec_stream_args(
    sandbox_id: str,
    cmd: str | list[str],
    timeout_s: float = 60.0,
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    stdin: bytes | None = None,
    max_output_bytes: int = 1 << 20,
) -> dict[str, Any]:
    """The arguments exec_stream takes (checked against this signature, like every method's)."""
    return {"sandbox_id": sandbox_id, "cmd": cmd, "timeout_s": timeout_s, "cwd": cwd, "env": env, "stdin": stdin, "max_output_bytes": max_output_bytes}


def _line(record: dict[str, Any]) -> bytes:
    return json.dumps(record).encode() + b"\n"


async def disconnected(receive: Receive) -> None:
    """Returns when the client has gone. The body was read before the stream starts, so the next message is the
    disconnect; the stream itself may be silent for long (a command waiting), so waiting for a failed write would not do."""
    while (await receive())["type"] != "http.disconnect":
        continue


def start(service: SandboxService | TenantView, pool: WorkerPool, kwargs: dict[str, Any], receive: Receive) -> StreamingResponse:
    """Run the (already checked) exec on `pool`, whose slot the caller holds; the slot is released when the command ends."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=QUEUE_CHUNKS)
    stop = threading.Event()

    def put(item: bytes | None) -> None:
        # After `stop` nobody reads: dropping keeps this thread from waiting on a queue no one drains.
        if not stop.is_set():
            asyncio.run_coroutine_threadsafe(queue.put(item), loop).result()

    def on_output(stream: str, chunk: bytes) -> None:
        put(_line({"stream": stream, **to_jsonable(chunk)}))

    def work() -> None:
        try:
            result = service.exec_streaming(on_output=on_output, stop=stop, **kwargs)
            put(_line({"result": to_jsonable(result)}))
        except Exception as e:
            put(_line({"error": errors.record("exec_stream", e)}))
        finally:
            put(None)

    job = pool.submit(work)
    job.add_done_callback(lambda _: pool.release())

    async def lines() -> AsyncIterator[bytes]:
        gone = asyncio.ensure_future(disconnected(receive))
        try:
            while True:
                item = asyncio.ensure_future(queue.get())
                await asyncio.wait({item, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not item.done():
                    item.cancel()
                    return
                line = item.result()
                if line is None:
                    return
                yield line
        finally:
            gone.cancel()
            stop.set()
            while not queue.empty():  # unblock a put that was waiting for room when the client left
                queue.get_nowait()

    return StreamingResponse(lines(), media_type="application/x-ndjson")
