"""Python clients of the sandbox server, sync (`SandboxClient`) and asyncio (`AsyncSandboxClient`), with the same methods.

Both share one method table (`_Methods`); each method returns `self._invoke(...)`, which is a value in the sync client and an
awaitable in the async one. Errors come back as the server's exception types (NotFound, InvalidArgument, Busy, ...) with its
message; an unreachable server raises SandboxError naming the URL. The async client bounds its concurrent requests with a
connection pool of `max_connections`.

Archives stream both ways: `upload_tar`/`import_snapshot` send bytes or a binary file object as the request body (read in
1 MiB chunks), `download_tar`/`export_snapshot` read the server's frames and return bytes, or write into `out` when given.
`limits` (protocol.ArchiveLimits) lowers the server's archive limits for one call.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import IO, Any

import httpx

from openk3.sandbox.protocol import (
    ERRORS_BY_NAME,
    ArchiveLimits,
    DirEntry,
    ExecResult,
    FrameParser,
    Limits,
    SandboxError,
    SandboxStats,
    SnapshotInfo,
    from_jsonable,
    to_jsonable,
)


def _same(x: Any) -> Any:
    return x


def _bytes(x: Any) -> bytes:
    return x["b"].encode("latin-1")


def _raise_for(response: httpx.Response) -> Any:
    try:
        payload = response.json()
    except ValueError as e:
        raise SandboxError(f"sandbox server answered {response.status_code} with a non-JSON body") from e
    if response.status_code >= 400:
        err = payload.get("error", {}) if isinstance(payload, dict) else {}
        raise ERRORS_BY_NAME.get(err.get("type", ""), SandboxError)(err.get("message", f"HTTP {response.status_code}"))
    return payload["result"]


Archive = bytes | IO[bytes]
UPLOAD_CHUNK = 1 << 20


def _args(kwargs: dict[str, Any]) -> dict[str, Any]:
    return to_jsonable({k: v for k, v in kwargs.items() if v is not None})


def _chunks(data: IO[bytes]) -> Iterator[bytes]:
    while chunk := data.read(UPLOAD_CHUNK):
        yield chunk


async def _achunks(data: IO[bytes]) -> AsyncIterator[bytes]:
    for chunk in _chunks(data):
        yield chunk


class _Methods:
    def _invoke(self, method: str, kwargs: dict[str, Any], convert: Callable[[Any], Any]) -> Any:
        raise NotImplementedError

    def _send(self, method: str, kwargs: dict[str, Any], data: Archive, convert: Callable[[Any], Any]) -> Any:
        raise NotImplementedError

    def _receive(self, method: str, kwargs: dict[str, Any], out: IO[bytes] | None) -> Any:
        raise NotImplementedError

    def create(
        self,
        image: str | None = None,
        limits: Limits | None = None,
        env: dict[str, str] | None = None,
        workdir: str = "/root",
        ttl_s: float | None = None,
        services: tuple[str, ...] = (),
    ) -> Any:
        return self._invoke("create", {"image": image, "limits": limits, "env": env, "workdir": workdir, "ttl_s": ttl_s, "services": list(services)}, _same)

    def exec(
        self,
        sandbox_id: str,
        cmd: str | list[str],
        timeout_s: float = 60.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | None = None,
        max_output_bytes: int = 1 << 20,
    ) -> Any:
        return self._invoke(
            "exec",
            {"sandbox_id": sandbox_id, "cmd": cmd, "timeout_s": timeout_s, "cwd": cwd, "env": env, "stdin": stdin, "max_output_bytes": max_output_bytes},
            lambda r: from_jsonable(ExecResult, r),
        )

    def read_file(self, sandbox_id: str, path: str, max_bytes: int = 64 << 20) -> Any:
        return self._invoke("read_file", {"sandbox_id": sandbox_id, "path": path, "max_bytes": max_bytes}, _bytes)

    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> Any:
        return self._invoke("write_file", {"sandbox_id": sandbox_id, "path": path, "data": data, "mode": mode}, _same)

    def list_dir(self, sandbox_id: str, path: str = "/") -> Any:
        return self._invoke("list_dir", {"sandbox_id": sandbox_id, "path": path}, lambda r: [from_jsonable(DirEntry, e) for e in r])

    def upload_tar(self, sandbox_id: str, data: Archive, dest: str = "/", limits: ArchiveLimits | None = None) -> Any:
        return self._send("upload_tar", {"sandbox_id": sandbox_id, "dest": dest, "limits": limits}, data, _same)

    def download_tar(self, sandbox_id: str, path: str, limits: ArchiveLimits | None = None, out: IO[bytes] | None = None) -> Any:
        return self._receive("download_tar", {"sandbox_id": sandbox_id, "path": path, "limits": limits}, out)

    def open_shell(self, sandbox_id: str, cwd: str | None = None, env: dict[str, str] | None = None) -> Any:
        return self._invoke("open_shell", {"sandbox_id": sandbox_id, "cwd": cwd, "env": env}, _same)

    def shell_run(self, shell_id: str, cmd: str, timeout_s: float = 60.0, max_output_bytes: int = 1 << 20) -> Any:
        return self._invoke(
            "shell_run",
            {"shell_id": shell_id, "cmd": cmd, "timeout_s": timeout_s, "max_output_bytes": max_output_bytes},
            lambda r: from_jsonable(ExecResult, r),
        )

    def close_shell(self, shell_id: str) -> Any:
        return self._invoke("close_shell", {"shell_id": shell_id}, _same)

    def create_env(self, factory: str, kwargs: dict | None = None, pythonpath: list[str] | None = None, memory_bytes: int | None = None) -> Any:
        return self._invoke("create_env", {"factory": factory, "kwargs": kwargs, "pythonpath": pythonpath, "memory_bytes": memory_bytes}, _same)

    def call_env(self, env_id: str, method: str, args: list | None = None, kwargs: dict | None = None) -> Any:
        return self._invoke("call_env", {"env_id": env_id, "method": method, "args": args, "kwargs": kwargs}, _same)

    def snapshot(self, source_id: str, kind: str = "fs") -> Any:
        return self._invoke("snapshot", {"source_id": source_id, "kind": kind}, lambda r: from_jsonable(SnapshotInfo, r))

    def restore(self, target_id: str, snapshot_id: str) -> Any:
        return self._invoke("restore", {"target_id": target_id, "snapshot_id": snapshot_id}, _same)

    def fork(self, source_id: str, n: int) -> Any:
        return self._invoke("fork", {"source_id": source_id, "n": n}, list)

    def delete_snapshot(self, snapshot_id: str) -> Any:
        return self._invoke("delete_snapshot", {"snapshot_id": snapshot_id}, _same)

    def destroy(self, target_id: str) -> Any:
        return self._invoke("destroy", {"target_id": target_id}, _same)

    def stats(self, sandbox_id: str) -> Any:
        return self._invoke("stats", {"sandbox_id": sandbox_id}, lambda r: from_jsonable(SandboxStats, r))

    def heartbeat(self, sandbox_id: str, ttl_s: float | None = None) -> Any:
        return self._invoke("heartbeat", {"sandbox_id": sandbox_id, "ttl_s": ttl_s}, _same)

    def export_snapshot(self, snapshot_id: str, skip_layers: tuple[str, ...] = (), out: IO[bytes] | None = None) -> Any:
        return self._receive("export_snapshot", {"snapshot_id": snapshot_id, "skip_layers": list(skip_layers)}, out)

    def import_snapshot(self, data: Archive, limits: ArchiveLimits | None = None) -> Any:
        return self._send("import_snapshot", {"limits": limits}, data, lambda r: from_jsonable(SnapshotInfo, r))


class SandboxClient(_Methods):
    def __init__(self, base_url: str, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s)

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


class AsyncSandboxClient(_Methods):
    def __init__(self, base_url: str, timeout_s: float = 600.0, max_connections: int = 16) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, limits=httpx.Limits(max_connections=max_connections))

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
