"""HTTP front of a host's SandboxService: `POST /v1/<method>` with the method's keyword arguments as a JSON object.

One route per API method keeps the client, the server and the Python API the same list of names. Arguments are validated
against the method's signature (pydantic), so a bad field answers 400 naming it. Backend calls are blocking and run in a
bounded pool of `workers` threads; at most `max_queue` more may wait, beyond that the server answers 503 at once. Bytes
travel as {"b": latin-1 string} (see protocol.to_jsonable). A background thread reaps sandboxes whose TTL expired.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from openk3.sandbox.api.service import SandboxService
from openk3.sandbox.protocol import Busy, InvalidArgument, SandboxError, to_jsonable

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


def _error(exc: SandboxError) -> JSONResponse:
    return JSONResponse(status_code=exc.status, content={"error": {"type": type(exc).__name__, "message": str(exc)}})


def create_app(service: SandboxService, workers: int = 8, max_queue: int = 64, reap_interval_s: float | None = 5.0) -> FastAPI:
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox")
    slots = threading.BoundedSemaphore(workers + max_queue)
    validated = {name: pydantic.validate_call(getattr(service, name)) for name in METHODS}
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

    @app.post("/v1/{method}")
    async def call(method: str, request: Request) -> JSONResponse:
        if method not in validated:
            return JSONResponse(status_code=404, content={"error": {"type": "NotFound", "message": f"method={method!r}: expected one of {list(METHODS)}"}})
        try:
            body = await request.json()
        except ValueError:
            return _error(InvalidArgument("request body: expected a JSON object of keyword arguments"))
        if not isinstance(body, dict):
            return _error(InvalidArgument("request body: expected a JSON object of keyword arguments"))
        if not slots.acquire(blocking=False):
            return _error(Busy(f"server busy: {workers} workers and {max_queue} queued requests in use; retry later"))
        try:
            result = await asyncio.get_running_loop().run_in_executor(pool, lambda: validated[method](**_decode(body)))
        except pydantic.ValidationError as e:
            fields = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
            return _error(InvalidArgument(f"{method}: {fields}"))
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
