"""HTTP front of a host's SandboxService: `POST /v1/<method>` with the method's keyword arguments as a JSON object.

One route per API method keeps the client, the server and the Python API the same list of names. Arguments are validated
against the method's signature (pydantic), so a bad or unknown field answers 400 naming it. Backend calls are blocking and
run in two bounded pools of threads (pool.py): calls whose length the caller picks (exec, shell commands, archives,
environment calls, exec_stream, process_wait) in one, everything else in the other, so long execs never hold up create or
list; beyond a pool's workers plus `max_queue` the server answers 503 at once. Bytes inside JSON travel as {"b64": ...}
(protocol.to_jsonable); whole files travel raw: `read_file` answers application/octet-stream and `write_file` takes the
file as the request body. With `api_key` set every request needs `Authorization: Bearer <key>` (auth.py). A background
thread reaps sandboxes whose TTL expired; that maintenance (`reap_expired`, like `close`) is no route, since a caller's
`{"now": 1e12}` would destroy every sandbox.

Tenancy: with a keys file (`tenants`, tenants.py) instead of one key, each key names a tenant and each request is served
by that tenant's TenantView (tenant_view.py): it sees, lists and acts on its own sandboxes, snapshots, processes and shells
only, within its quotas, and any other id is a 404 that says no more than a missing one. `GET /metrics` covers every tenant,
so only an operator tenant may read it (others get 404).

Archives travel raw too: `upload_tar` and `import_snapshot` take the (optionally zstd) archive as the request body, and
`write_file` the file, with their other arguments as JSON in the `args` query parameter, read in chunks as the service
consumes them; `download_tar` and `export_snapshot` answer a stream of frames (protocol.frame) produced chunk by chunk in
the worker pool, `exec_stream` NDJSON lines (exec_stream.py), `pty_stream` and `watch_stream` NDJSON lines of a terminal's
output or a watch's events (item_stream.py). A request holds its worker slot until its stream ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from openk3.sandbox.api import auth, errors, exec_stream, item_stream, metrics
from openk3.sandbox.api.body import Body
from openk3.sandbox.api.pool import WorkerPool
from openk3.sandbox.api.service import SandboxService
from openk3.sandbox.api.tenant_ledger import TenantLedger
from openk3.sandbox.api.tenant_view import TenantView
from openk3.sandbox.api.tenants import Tenants
from openk3.sandbox.protocol import (
    FRAME_DATA,
    FRAME_END,
    ArchiveLimits,
    InvalidArgument,
    SandboxError,
    decode_tagged,
    frame,
    to_jsonable,
)

logger = logging.getLogger(__name__)

METHODS = (
    "create",
    "list_sandboxes",
    "exec",
    "exec_stream",
    "spawn",
    "process_status",
    "process_output",
    "process_wait",
    "process_kill",
    "process_write_stdin",
    "process_close_stdin",
    "process_signal",
    "pty_create",
    "pty_write",
    "pty_resize",
    "pty_read",
    "pty_stream",
    "pty_status",
    "pty_wait",
    "pty_kill",
    "watch_dir",
    "watch_events",
    "watch_stream",
    "watch_stop",
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
)
# Calls that last as long as the caller's command, archive or environment call: the long pool.
LONG = frozenset(
    {"exec", "exec_stream", "process_wait", "shell_run", "call_env", "upload_tar", "download_tar", "export_snapshot", "import_snapshot"}
    | {"process_write_stdin", "pty_write", "pty_read", "pty_stream", "pty_wait", "watch_events", "watch_stream"}
)
MAX_FILE_BYTES = 64 << 20  # write_file bodies, as read_file's default max_bytes


# Body methods: the body in (the archive, or the file), their other arguments checked by these signatures.
def _upload_tar_args(sandbox_id: str, dest: str = "/", limits: ArchiveLimits | None = None) -> dict[str, Any]:
    return {"sandbox_id": sandbox_id, "dest": dest, "limits": limits}


def _import_snapshot_args(limits: ArchiveLimits | None = None) -> dict[str, Any]:
    return {"limits": limits}


def _write_file_args(sandbox_id: str, path: str, mode: int = 0o644) -> dict[str, Any]:
    return {"sandbox_id": sandbox_id, "path": path, "mode": mode}


BODY_ARGS: dict[str, Callable[..., dict[str, Any]]] = {"upload_tar": _upload_tar_args, "import_snapshot": _import_snapshot_args, "write_file": _write_file_args}
WHOLE_BODY = frozenset({"write_file"})  # read whole (at most MAX_FILE_BYTES) before the call; archives stream
STREAMED = {"download_tar": "download_tar_stream", "export_snapshot": "export_snapshot_stream"}
RAW_RESULT = frozenset({"read_file"})  # bytes answered as application/octet-stream
ITEM_STREAMS = frozenset({"pty_stream", "watch_stream"})  # NDJSON of a handle's news (item_stream.py)


def _next_chunk(chunks: Iterator[bytes]) -> bytes | None:
    for chunk in chunks:
        if chunk:
            return chunk
    return None


def _answer(method: str, result: Any) -> Response:
    if method in RAW_RESULT:
        return Response(content=result, media_type="application/octet-stream")
    return JSONResponse(content={"result": to_jsonable(result)})


async def _guarded(method: str, call: Callable[[], Awaitable[Response]]) -> Response:
    """`call`'s answer, or the JSON error for what it raised (a bug or a host failure still answers with its type named)."""
    try:
        return await call()
    except pydantic.ValidationError as e:
        return errors.invalid(method, e)
    except SandboxError as e:
        return errors.response(e)
    except Exception as e:
        logger.exception("sandbox %s failed", method)
        return errors.response(SandboxError(f"{method}: internal error: {type(e).__name__}: {e}"))


def create_app(
    service: SandboxService,
    workers: int = 8,
    max_queue: int = 64,
    reap_interval_s: float | None = 5.0,
    long_workers: int = 64,
    api_key: str | None = None,
    tenants: Tenants | None = None,
) -> FastAPI:
    """The app; `workers` threads for short calls, `long_workers` for execs and transfers (threads mostly waiting on pipes);
    either one `api_key` for everything or `tenants`, a key per tenant."""
    if api_key is not None and tenants is not None:
        raise InvalidArgument("api_key and tenants: give one key or a keys file, not both")
    short = WorkerPool("short", workers, max_queue)
    long = WorkerPool("long", long_workers, max_queue)
    pools = {name: long if name in LONG else short for name in METHODS}
    plain = [name for name in METHODS if name not in BODY_ARGS and name not in STREAMED and name != "exec_stream"]
    # What a request calls: the service itself, or (tenancy) the view of the tenant whose key it carries.
    apis: dict[str | None, SandboxService | TenantView] = {None: service}
    ledger = None
    if tenants is not None:
        ledger = TenantLedger(tenants, lambda: set(service.backend.sandboxes()) | {i for i in service.envs.ids() if i.startswith("pe-")})
        apis = {name: TenantView(service, tenant, ledger) for name, tenant in tenants.by_name.items()}
    validated_by_api: dict[str | None, dict[str, Callable[..., Any]]] = {}
    for who, api in apis.items():
        calls = {name: pydantic.validate_call(getattr(api, name)) for name in plain}
        calls.update({name: pydantic.validate_call(getattr(api, target)) for name, target in STREAMED.items()})
        validated_by_api[who] = calls
    body_args = {name: pydantic.validate_call(fn) for name, fn in BODY_ARGS.items()}
    stream_args = pydantic.validate_call(exec_stream.exec_stream_args)
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
        short.shutdown()
        long.shutdown()

    app = FastAPI(title="openk3 sandbox", lifespan=lifespan)

    if api_key is not None:
        key = api_key

        @app.middleware("http")
        async def require_key(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
            return await call_next(request) if auth.authorized(request, key) else auth.unauthorized()

    if tenants is not None:
        keys = tenants

        @app.middleware("http")
        async def identify_tenant(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
            tenant = keys.identify(auth.bearer_token(request.headers.get("authorization", "")))
            if tenant is None:
                return auth.unauthorized()
            request.state.tenant = tenant.name
            return await call_next(request)

    def tenant_of(request: Request) -> str | None:
        return getattr(request.state, "tenant", None)

    metrics_registry = metrics.registry(service, ledger.figures if ledger is not None else None)

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        who = tenant_of(request)
        if tenants is not None and (who is None or not tenants.by_name[who].operator):
            return JSONResponse(status_code=404, content={"error": {"type": "NotFound", "message": "/metrics: not found"}})
        return Response(content=metrics.render(metrics_registry), media_type=metrics.CONTENT_TYPE)

    @app.get("/v1/health")
    async def health(request: Request) -> dict[str, Any]:
        api = apis[tenant_of(request)]
        live = len(api.list_sandboxes()) if isinstance(api, TenantView) else len(service.backend.sandboxes())
        return {"ok": True, "host": service.backend.config.host, "cgroups": service.backend.layout.name, "sandboxes": live}

    async def in_pool(method: str, fn: Callable[[], Any]) -> Any:
        pool = pools[method]
        pool.acquire()
        try:
            return await pool.run(fn)
        finally:
            pool.release()

    async def with_body(method: str, request: Request, api: SandboxService | TenantView) -> Response:
        try:
            args = json.loads(request.query_params.get("args", "{}"))
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise InvalidArgument(f"{method}: the args query parameter must be a JSON object")
        kwargs = body_args[method](**args)
        body = Body(request, asyncio.get_running_loop())

        def run() -> Any:
            data = body.read_all(MAX_FILE_BYTES, method) if method in WHOLE_BODY else body
            return getattr(api, method)(data=data, **kwargs)

        return _answer(method, await in_pool(method, run))

    async def streamed(method: str, kwargs: dict[str, Any], validated: dict[str, Callable[..., Any]]) -> Response:
        pool = pools[method]
        pool.acquire()
        try:
            chunks = validated[method](**kwargs)
            first = await pool.run(lambda: _next_chunk(chunks))  # errors before any byte (NotFound, bad limits) stay 4xx
        except BaseException:
            pool.release()
            raise

        async def frames() -> AsyncIterator[bytes]:
            try:
                chunk = first
                while chunk is not None:
                    yield frame(FRAME_DATA, chunk)
                    try:
                        chunk = await pool.run(lambda: _next_chunk(chunks))
                    except Exception as e:
                        yield errors.error_frame(method, e)
                        return
                yield frame(FRAME_END)
            finally:
                try:
                    await pool.run(chunks.close)  # a download stopped early closes its pipe, so the sandbox's tar exits
                finally:
                    pool.release()

        return StreamingResponse(frames(), media_type="application/octet-stream")

    async def exec_streamed(kwargs: dict[str, Any], request: Request, api: SandboxService | TenantView) -> Response:
        checked = stream_args(**kwargs)
        pool = pools["exec_stream"]
        pool.acquire()
        try:
            # Refusals before the command starts (unknown sandbox, bad timeout or env) stay a 4xx answer, not a stream line.
            await pool.run(
                lambda: api.check_exec(checked["sandbox_id"], checked["cmd"], checked["timeout_s"], checked["cwd"], checked["env"], checked["max_output_bytes"])
            )
            return exec_stream.start(api, pool, checked, request.receive)
        except BaseException:
            pool.release()
            raise

    async def item_streamed(method: str, kwargs: dict[str, Any], request: Request, validated: dict[str, Callable[..., Any]]) -> Response:
        pool = pools[method]
        pool.acquire()
        try:
            items = await pool.run(lambda: validated[method](**kwargs))  # an unknown handle or a bad offset stays a 4xx answer
            return item_stream.start(method, pool, items, request.receive)
        except BaseException:
            pool.release()
            raise

    async def dispatch(method: str, request: Request) -> Response:
        who = tenant_of(request)
        api, validated = apis[who], validated_by_api[who]
        if method in BODY_ARGS:
            return await with_body(method, request, api)
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise InvalidArgument("request body: expected a JSON object of keyword arguments")
        kwargs = decode_tagged(body)
        if method == "exec_stream":
            return await exec_streamed(kwargs, request, api)
        if method in STREAMED:
            return await streamed(method, kwargs, validated)
        if method in ITEM_STREAMS:
            return await item_streamed(method, kwargs, request, validated)
        return _answer(method, await in_pool(method, lambda: validated[method](**kwargs)))

    @app.post("/v1/{method}", response_model=None)
    async def call(method: str, request: Request) -> Response:
        if method not in METHODS:
            return JSONResponse(status_code=404, content={"error": {"type": "NotFound", "message": f"method={method!r}: expected one of {list(METHODS)}"}})
        return await _guarded(method, lambda: dispatch(method, request))

    return app


def serve(service: SandboxService, host: str, port: int, workers: int, api_key: str | None = None, tenants: Tenants | None = None) -> None:
    import uvicorn

    uvicorn.run(create_app(service, workers=workers, api_key=api_key, tenants=tenants), host=host, port=port, log_level="warning")
