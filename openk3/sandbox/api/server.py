"""HTTP front of a host's SandboxService: `POST /v1/<method>` with the method's keyword arguments as a JSON object.

One route per API method keeps the client, the server and the Python API the same list of names. Arguments are validated
against the method's signature (pydantic), so a bad field answers 400 naming it. Backend calls are blocking and run in a
bounded pool of `workers` threads; at most `max_queue` more may wait, beyond that the server answers 503 at once. Bytes
travel as {"b": latin-1 string} (see protocol.to_jsonable). A background thread reaps sandboxes whose TTL expired.

Archives never travel that way: `upload_tar` and `import_snapshot` take the raw (optionally zstd) archive as the request body
with their other arguments as JSON in the `args` query parameter, read in chunks as the service consumes them;
`download_tar` and `export_snapshot` answer a stream of frames (protocol.frame) produced chunk by chunk in the worker pool.
The request holds its worker slot until the stream ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from openk3.sandbox.api.service import SandboxService
from openk3.sandbox.protocol import ERRORS_BY_NAME, FRAME_DATA, FRAME_END, FRAME_ERROR, ArchiveLimits, Busy, InvalidArgument, SandboxError, frame, to_jsonable

logger = logging.getLogger(__name__)

METHODS = (
    "create",
    "exec",
    "read_file",
    "write_file",
    "list_dir",
    "upload_tar",
    "download_tar",
    "open_shell",
    "shell_run",
    "close_shell",
    "create_env",
    "call_env",
    "snapshot",
    "restore",
    "fork",
    "delete_snapshot",
    "destroy",
    "stats",
    "heartbeat",
    "export_snapshot",
    "import_snapshot",
    "reap_expired",
)


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"b"} and isinstance(value["b"], str):
            return value["b"].encode("latin-1")
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


# Archive methods: bodies in (their arguments besides the archive, checked by these signatures) and streams out.
def _upload_tar_args(sandbox_id: str, dest: str = "/", limits: ArchiveLimits | None = None) -> dict[str, Any]:
    return {"sandbox_id": sandbox_id, "dest": dest, "limits": limits}


def _import_snapshot_args(limits: ArchiveLimits | None = None) -> dict[str, Any]:
    return {"limits": limits}


BODY_ARGS: dict[str, Callable[..., dict[str, Any]]] = {"upload_tar": _upload_tar_args, "import_snapshot": _import_snapshot_args}
STREAMED = {"download_tar": "download_tar_stream", "export_snapshot": "export_snapshot_stream"}


class _Body:
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


def _next_chunk(chunks: Iterator[bytes]) -> bytes | None:
    for chunk in chunks:
        if chunk:
            return chunk
    return None


def _type_name(exc: SandboxError) -> str:
    """The nearest error type the clients know (ArchiveRefused travels as InvalidArgument)."""
    return next(c.__name__ for c in type(exc).__mro__ if c.__name__ in ERRORS_BY_NAME)


def _error_frame(method: str, exc: Exception) -> bytes:
    if not isinstance(exc, SandboxError):
        logger.error("sandbox %s failed mid-stream", method, exc_info=exc)
        exc = SandboxError(f"{method}: internal error: {type(exc).__name__}: {exc}")
    return frame(FRAME_ERROR, json.dumps({"type": _type_name(exc), "message": str(exc)}).encode())


def _error(exc: SandboxError) -> JSONResponse:
    return JSONResponse(status_code=exc.status, content={"error": {"type": _type_name(exc), "message": str(exc)}})


def create_app(service: SandboxService, workers: int = 8, max_queue: int = 64, reap_interval_s: float | None = 5.0) -> FastAPI:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox")
    slots = threading.BoundedSemaphore(workers + max_queue)
    plain = [name for name in METHODS if name not in BODY_ARGS and name not in STREAMED]
    validated = {name: pydantic.validate_call(getattr(service, name)) for name in plain}
    validated.update({name: pydantic.validate_call(getattr(service, target)) for name, target in STREAMED.items()})
    body_args = {name: pydantic.validate_call(fn) for name, fn in BODY_ARGS.items()}
    stop = threading.Event()

    def reaper() -> None:
        while reap_interval_s is not None and not stop.wait(reap_interval_s):
            try:
                service.reap_expired()
            except Exception:  # keep reaping; one sandbox that fails to tear down must not stop the others' TTLs
                logger.exception("TTL reaping failed")

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        reaper_thread = threading.Thread(target=reaper, name="sandbox-reaper", daemon=True)
        if reap_interval_s is not None:
            reaper_thread.start()
        yield
        stop.set()
        pool.shutdown(wait=True)

    app = FastAPI(title="openk3 sandbox", lifespan=lifespan)

    @app.get("/v1/health")
    async def health() -> dict[str, Any]:
        return {"ok": True, "host": service.backend.config.host, "cgroups": service.backend.layout.name, "sandboxes": len(service.backend.sandboxes())}

    def invalid(method: str, e: pydantic.ValidationError) -> JSONResponse:
        fields = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
        return _error(InvalidArgument(f"{method}: {fields}"))

    async def in_pool(fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn)

    async def with_body(method: str, request: Request) -> JSONResponse:
        try:
            args = json.loads(request.query_params.get("args", "{}"))
        except ValueError:
            return _error(InvalidArgument(f"{method}: the args query parameter must be a JSON object"))
        if not isinstance(args, dict):
            return _error(InvalidArgument(f"{method}: the args query parameter must be a JSON object"))
        if not slots.acquire(blocking=False):
            return _error(Busy(f"server busy: {workers} workers and {max_queue} queued requests in use; retry later"))
        try:
            kwargs = body_args[method](**args)
            body = _Body(request, asyncio.get_running_loop())
            result = await in_pool(lambda: getattr(service, method)(data=body, **kwargs))
        except pydantic.ValidationError as e:
            return invalid(method, e)
        except SandboxError as e:
            return _error(e)
        except Exception as e:
            logger.exception("sandbox %s failed", method)
            return _error(SandboxError(f"{method}: internal error: {type(e).__name__}: {e}"))
        finally:
            slots.release()
        return JSONResponse(content={"result": to_jsonable(result)})

    async def streamed(method: str, kwargs: dict[str, Any]) -> JSONResponse | StreamingResponse:
        if not slots.acquire(blocking=False):
            return _error(Busy(f"server busy: {workers} workers and {max_queue} queued requests in use; retry later"))
        try:
            chunks = validated[method](**kwargs)
            first = await in_pool(lambda: _next_chunk(chunks))  # errors before any byte (NotFound, bad limits) stay 4xx
        except pydantic.ValidationError as e:
            slots.release()
            return invalid(method, e)
        except SandboxError as e:
            slots.release()
            return _error(e)
        except Exception as e:
            slots.release()
            logger.exception("sandbox %s failed", method)
            return _error(SandboxError(f"{method}: internal error: {type(e).__name__}: {e}"))

        async def frames() -> AsyncIterator[bytes]:
            try:
                chunk = first
                while chunk is not None:
                    yield frame(FRAME_DATA, chunk)
                    try:
                        chunk = await in_pool(lambda: _next_chunk(chunks))
                    except Exception as e:
                        yield _error_frame(method, e)
                        return
                yield frame(FRAME_END)
            finally:
                try:
                    await in_pool(chunks.close)  # a download stopped early closes its pipe, so the sandbox's tar exits
                finally:
                    slots.release()

        return StreamingResponse(frames(), media_type="application/octet-stream")

    @app.post("/v1/{method}", response_model=None)
    async def call(method: str, request: Request) -> JSONResponse | StreamingResponse:
        if method in BODY_ARGS:
            return await with_body(method, request)
        if method not in validated:
            return JSONResponse(status_code=404, content={"error": {"type": "NotFound", "message": f"method={method!r}: expected one of {list(METHODS)}"}})
        try:
            body = await request.json()
        except ValueError:
            return _error(InvalidArgument("request body: expected a JSON object of keyword arguments"))
        if not isinstance(body, dict):
            return _error(InvalidArgument("request body: expected a JSON object of keyword arguments"))
        if method in STREAMED:
            return await streamed(method, _decode(body))
        if not slots.acquire(blocking=False):
            return _error(Busy(f"server busy: {workers} workers and {max_queue} queued requests in use; retry later"))
        try:
            result = await in_pool(lambda: validated[method](**_decode(body)))
        except pydantic.ValidationError as e:
            return invalid(method, e)
        except SandboxError as e:
            return _error(e)
        except Exception as e:  # a bug or a host failure: still a JSON error the clients can raise, with its type named
            logger.exception("sandbox %s failed", method)
            return _error(SandboxError(f"{method}: internal error: {type(e).__name__}: {e}"))
        finally:
            slots.release()
        return JSONResponse(content={"result": to_jsonable(result)})

    return app


def serve(service: SandboxService, host: str, port: int, workers: int) -> None:
    import uvicorn

    uvicorn.run(create_app(service, workers=workers), host=host, port=port, log_level="warning")
