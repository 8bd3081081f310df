"""Python clients of the sandbox server, sync (`SandboxClient`) and asyncio (`AsyncSandboxClient`), with the same methods.

Both share one method table (`Methods`, client_methods.py); each method returns `self._invoke(...)`, which is a value in the sync client and an
awaitable in the async one. Errors come back as the server's exception types (NotFound, InvalidArgument, Busy, ...) with its
message; an unreachable server raises SandboxError naming the URL. The async client bounds its concurrent requests with a
connection pool of `max_connections`.

Archives stream both ways: `upload_tar`/`import_snapshot` send bytes or a binary file object as the request body (read in
1 MiB chunks), `download_tar`/`export_snapshot` read the server's frames and return bytes, or write into `out` when given.
`limits` (protocol.ArchiveLimits) lowers the server's archive limits for one call. Files travel raw (`write_file` as the
body, `read_file` as the answer); `exec_stream` yields OutputChunk items as the command writes them, then its ExecResult;
`pty_stream` and `watch_stream` yield a terminal's output and a watch's events as they come (NDJSON, item_stream.py).
`api_key` (default: the OPENK3_SANDBOX_API_KEY variable) is sent as `Authorization: Bearer <key>`.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import AsyncIterator, Callable, Iterator
from typing import IO, Any

import httpx

from openk3.sandbox.api.client_methods import Archive, Methods
from openk3.sandbox.protocol import (
    ERRORS_BY_NAME,
    ExecResult,
    FrameParser,
    OutputChunk,
    SandboxError,
    decode_bytes,
    from_jsonable,
    to_jsonable,
)
from openk3.sandbox.protocol_interactive import PtyOutput, WatchEvent

API_KEY_ENV = "OPENK3_SANDBOX_API_KEY"  # auth.ENV_VAR; not imported from there, which needs the server's packages


def _raise_for(response: httpx.Response) -> Any:
    if response.status_code < 400 and response.headers.get("content-type") == "application/octet-stream":
        return response.content  # read_file
    try:
        payload = response.json()
    except ValueError as e:
        raise SandboxError(f"sandbox server answered {response.status_code} with a non-JSON body") from e
    if response.status_code >= 400:
        err = payload.get("error", {}) if isinstance(payload, dict) else {}
        raise ERRORS_BY_NAME.get(err.get("type", ""), SandboxError)(err.get("message", f"HTTP {response.status_code}"))
    return payload["result"]


def _headers(api_key: str | None) -> dict[str, str]:
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


def _record(line: bytes) -> OutputChunk | ExecResult:
    """One exec_stream line: a chunk of output, or the final result; an error line raises."""
    rec = json.loads(line)
    if "stream" in rec:
        return OutputChunk(stream=rec["stream"], data=decode_bytes({"b64": rec["b64"]}))
    if "result" in rec:
        return from_jsonable(ExecResult, rec["result"])
    err = rec.get("error", {})
    raise ERRORS_BY_NAME.get(err.get("type", ""), SandboxError)(err.get("message", "exec_stream failed"))


def _item(line: bytes, convert: Callable[[Any], Any]) -> tuple[bool, Any]:
    """(ended, item) of one pty_stream or watch_stream line (item None for an idle line); an error line raises."""
    rec = json.loads(line)
    if "item" in rec:
        return False, convert(rec["item"])
    if "error" in rec:
        err = rec["error"]
        raise ERRORS_BY_NAME.get(err.get("type", ""), SandboxError)(err.get("message", "stream failed"))
    return bool(rec.get("end")), None


def _stream_gone(method: str, base_url: str) -> SandboxError:
    return SandboxError(f"{method}: the stream from {base_url} ended before its end line")


PTY_OUTPUT = functools.partial(from_jsonable, PtyOutput)
WATCH_EVENT = functools.partial(from_jsonable, WatchEvent)
UPLOAD_CHUNK = 1 << 20


def _args(kwargs: dict[str, Any]) -> dict[str, Any]:
    return to_jsonable({k: v for k, v in kwargs.items() if v is not None})


def _chunks(data: IO[bytes]) -> Iterator[bytes]:
    while chunk := data.read(UPLOAD_CHUNK):
        yield chunk


async def _achunks(data: IO[bytes]) -> AsyncIterator[bytes]:
    for chunk in _chunks(data):
        yield chunk


def _stream_args(
    sandbox_id: str, cmd: str | list[str], timeout_s: float, cwd: str | None, env: dict[str, str] | None, stdin: bytes | None, max_output_bytes: int
) -> dict[str, Any]:
    return _args({"sandbox_id": sandbox_id, "cmd": cmd, "timeout_s": timeout_s, "cwd": cwd, "env": env, "stdin": stdin, "max_output_bytes": max_output_bytes})


class SandboxClient(Methods):
    def __init__(self, base_url: str, timeout_s: float = 600.0, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=_headers(api_key))

    def exec_stream(
        self,
        sandbox_id: str,
        cmd: str | list[str],
        timeout_s: float = 60.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | None = None,
        max_output_bytes: int = 1 << 20,
    ) -> Iterator[OutputChunk | ExecResult]:
        """OutputChunk items as the command writes them, then its ExecResult (stdout/stderr empty); closing early kills it."""
        body = _stream_args(sandbox_id, cmd, timeout_s, cwd, env, stdin, max_output_bytes)
        try:
            with self._http.stream("POST", "/v1/exec_stream", json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    _raise_for(response)
                for line in response.iter_lines():
                    if line:
                        yield _record(line.encode())
        except httpx.TransportError as e:
            raise SandboxError(f"exec_stream: the stream from {self.base_url} failed: {e}") from e

    def _items(self, method: str, kwargs: dict[str, Any], convert: Callable[[Any], Any]) -> Iterator[Any]:
        try:
            with self._http.stream("POST", f"/v1/{method}", json=_args(kwargs)) as response:
                if response.status_code >= 400:
                    response.read()
                    _raise_for(response)
                for line in response.iter_lines():
                    ended, item = _item(line.encode(), convert) if line else (False, None)
                    if ended:
                        return
                    if item is not None:
                        yield item
        except httpx.TransportError as e:
            raise SandboxError(f"{method}: the stream from {self.base_url} failed: {e}") from e
        raise _stream_gone(method, self.base_url)

    def pty_stream(self, pty_id: str, offset: int = 0, max_bytes: int = 1 << 16) -> Iterator[PtyOutput]:
        """The terminal's output from `offset` as it comes (PtyOutput items), until the terminal ends (the last has more=False)."""
        return self._items("pty_stream", {"pty_id": pty_id, "offset": offset, "max_bytes": max_bytes}, PTY_OUTPUT)

    def watch_stream(self, watch_id: str) -> Iterator[WatchEvent]:
        """The watch's events as they come, until the watch ends (stopped, its directory gone, its sandbox restored)."""
        return self._items("watch_stream", {"watch_id": watch_id}, WATCH_EVENT)

    def _invoke(self, method: str, kwargs: dict[str, Any], convert: Callable[[Any], Any]) -> Any:
        try:
            response = self._http.post(f"/v1/{method}", json=_args(kwargs))
        except httpx.TransportError as e:
            raise SandboxError(f"cannot reach sandbox server at {self.base_url}: {e}") from e
        return convert(_raise_for(response))

    def _send(self, method: str, kwargs: dict[str, Any], data: Archive, convert: Callable[[Any], Any]) -> Any:
        content = data if isinstance(data, bytes) else _chunks(data)
        try:
            response = self._http.post(f"/v1/{method}", params={"args": json.dumps(_args(kwargs))}, content=content)
        except httpx.TransportError as e:
            raise SandboxError(f"cannot reach sandbox server at {self.base_url}: {e}") from e
        return convert(_raise_for(response))

    def _receive(self, method: str, kwargs: dict[str, Any], out: IO[bytes] | None) -> Any:
        parser, parts = FrameParser(), []
        try:
            with self._http.stream("POST", f"/v1/{method}", json=_args(kwargs)) as response:
                if response.status_code >= 400:
                    response.read()
                    _raise_for(response)
                for raw in response.iter_bytes():
                    for chunk in parser.feed(raw):
                        parts.append(chunk) if out is None else out.write(chunk)
        except httpx.TransportError as e:
            raise SandboxError(f"{method}: the stream from {self.base_url} failed: {e}") from e
        parser.close()
        return b"".join(parts) if out is None else None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SandboxClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncSandboxClient(Methods):
    def __init__(self, base_url: str, timeout_s: float = 600.0, max_connections: int = 16, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.base_url, timeout=timeout_s, limits=httpx.Limits(max_connections=max_connections), headers=_headers(api_key)
        )

    async def exec_stream(
        self,
        sandbox_id: str,
        cmd: str | list[str],
        timeout_s: float = 60.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | None = None,
        max_output_bytes: int = 1 << 20,
    ) -> AsyncIterator[OutputChunk | ExecResult]:
        """As SandboxClient.exec_stream, as an async iterator."""
        body = _stream_args(sandbox_id, cmd, timeout_s, cwd, env, stdin, max_output_bytes)
        try:
            async with self._http.stream("POST", "/v1/exec_stream", json=body) as response:
                if response.status_code >= 400:
                    await response.aread()
                    _raise_for(response)
                async for line in response.aiter_lines():
                    if line:
                        yield _record(line.encode())
        except httpx.TransportError as e:
            raise SandboxError(f"exec_stream: the stream from {self.base_url} failed: {e}") from e

    async def _items(self, method: str, kwargs: dict[str, Any], convert: Callable[[Any], Any]) -> AsyncIterator[Any]:
        try:
            async with self._http.stream("POST", f"/v1/{method}", json=_args(kwargs)) as response:
                if response.status_code >= 400:
                    await response.aread()
                    _raise_for(response)
                async for line in response.aiter_lines():
                    ended, item = _item(line.encode(), convert) if line else (False, None)
                    if ended:
                        return
                    if item is not None:
                        yield item
        except httpx.TransportError as e:
            raise SandboxError(f"{method}: the stream from {self.base_url} failed: {e}") from e
        raise _stream_gone(method, self.base_url)

    def pty_stream(self, pty_id: str, offset: int = 0, max_bytes: int = 1 << 16) -> AsyncIterator[PtyOutput]:
        """As SandboxClient.pty_stream, as an async iterator."""
        return self._items("pty_stream", {"pty_id": pty_id, "offset": offset, "max_bytes": max_bytes}, PTY_OUTPUT)

    def watch_stream(self, watch_id: str) -> AsyncIterator[WatchEvent]:
        """As SandboxClient.watch_stream, as an async iterator."""
        return self._items("watch_stream", {"watch_id": watch_id}, WATCH_EVENT)

    async def _call(self, method: str, kwargs: dict[str, Any], convert: Callable[[Any], Any]) -> Any:
        try:
            response = await self._http.post(f"/v1/{method}", json=_args(kwargs))
        except httpx.TransportError as e:
            raise SandboxError(f"cannot reach sandbox server at {self.base_url}: {e}") from e
        return convert(_raise_for(response))

    def _invoke(self, method: str, kwargs: dict[str, Any], convert: Callable[[Any], Any]) -> Any:
        return self._call(method, kwargs, convert)

    async def _asend(self, method: str, kwargs: dict[str, Any], data: Archive, convert: Callable[[Any], Any]) -> Any:
        content = data if isinstance(data, bytes) else _achunks(data)
        try:
            response = await self._http.post(f"/v1/{method}", params={"args": json.dumps(_args(kwargs))}, content=content)
        except httpx.TransportError as e:
            raise SandboxError(f"cannot reach sandbox server at {self.base_url}: {e}") from e
        return convert(_raise_for(response))

    def _send(self, method: str, kwargs: dict[str, Any], data: Archive, convert: Callable[[Any], Any]) -> Any:
        return self._asend(method, kwargs, data, convert)

    async def _areceive(self, method: str, kwargs: dict[str, Any], out: IO[bytes] | None) -> Any:
        parser, parts = FrameParser(), []
        try:
            async with self._http.stream("POST", f"/v1/{method}", json=_args(kwargs)) as response:
                if response.status_code >= 400:
                    await response.aread()
                    _raise_for(response)
                async for raw in response.aiter_bytes():
                    for chunk in parser.feed(raw):
                        parts.append(chunk) if out is None else out.write(chunk)
        except httpx.TransportError as e:
            raise SandboxError(f"{method}: the stream from {self.base_url} failed: {e}") from e
        parser.close()
        return b"".join(parts) if out is None else None

    def _receive(self, method: str, kwargs: dict[str, Any], out: IO[bytes] | None) -> Any:
        return self._areceive(method, kwargs, out)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncSandboxClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
