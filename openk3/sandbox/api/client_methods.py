"""The method table both sandbox clients share (client.py): one definition per API call, its arguments and how its answer is
rebuilt; each returns `self._invoke(...)` (or `_send`/`_receive` for bodies and streams), a value in the sync client and
an awaitable in the async one."""

from __future__ import annotations

from collections.abc import Callable
from typing import IO, Any

from openk3.sandbox.api.client_interactive import InteractiveMethods
from openk3.sandbox.protocol import (
    ArchiveLimits,
    DirEntry,
    ExecResult,
    Limits,
    ProcessOutput,
    ProcessStatus,
    SandboxInfo,
    SandboxStats,
    SnapshotInfo,
    decode_tagged,
    from_jsonable,
)

Archive = bytes | IO[bytes]


class Methods(InteractiveMethods):
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
        labels: dict[str, str] | None = None,
    ) -> Any:
        args = {"image": image, "limits": limits, "env": env, "workdir": workdir, "ttl_s": ttl_s, "services": list(services), "labels": labels}
        return self._invoke("create", args, decode_tagged)

    def list_sandboxes(self, labels: dict[str, str] | None = None) -> Any:
        return self._invoke("list_sandboxes", {"labels": labels}, lambda r: [from_jsonable(SandboxInfo, e) for e in r])

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

    def spawn(
        self,
        sandbox_id: str,
        cmd: str | list[str],
        timeout_s: float = 3600.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        max_output_bytes: int = 16 << 20,
        stdin: bool = False,
    ) -> Any:
        """Start `cmd` in the background; with `stdin`, its stdin is a pipe fed by process_write_stdin, else it reads EOF."""
        args = {"sandbox_id": sandbox_id, "cmd": cmd, "timeout_s": timeout_s, "cwd": cwd, "env": env, "max_output_bytes": max_output_bytes}
        return self._invoke("spawn", {**args, "stdin": stdin}, decode_tagged)

    def process_status(self, process_id: str) -> Any:
        return self._invoke("process_status", {"process_id": process_id}, lambda r: from_jsonable(ProcessStatus, r))

    def process_output(self, process_id: str, stdout_offset: int = 0, stderr_offset: int = 0, max_bytes: int = 1 << 20) -> Any:
        args = {"process_id": process_id, "stdout_offset": stdout_offset, "stderr_offset": stderr_offset, "max_bytes": max_bytes}
        return self._invoke("process_output", args, lambda r: from_jsonable(ProcessOutput, r))

    def process_wait(self, process_id: str, timeout_s: float = 60.0) -> Any:
        return self._invoke("process_wait", {"process_id": process_id, "timeout_s": timeout_s}, lambda r: from_jsonable(ProcessStatus, r))

    def process_kill(self, process_id: str) -> Any:
        return self._invoke("process_kill", {"process_id": process_id}, lambda r: from_jsonable(ProcessStatus, r))

    def read_file(self, sandbox_id: str, path: str, max_bytes: int = 64 << 20) -> Any:
        return self._invoke("read_file", {"sandbox_id": sandbox_id, "path": path, "max_bytes": max_bytes}, decode_tagged)

    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> Any:
        return self._send("write_file", {"sandbox_id": sandbox_id, "path": path, "mode": mode}, data, decode_tagged)

    def list_dir(self, sandbox_id: str, path: str = "/") -> Any:
        return self._invoke("list_dir", {"sandbox_id": sandbox_id, "path": path}, lambda r: [from_jsonable(DirEntry, e) for e in r])

    def upload_tar(self, sandbox_id: str, data: Archive, dest: str = "/", limits: ArchiveLimits | None = None) -> Any:
        return self._send("upload_tar", {"sandbox_id": sandbox_id, "dest": dest, "limits": limits}, data, decode_tagged)

    def download_tar(self, sandbox_id: str, path: str, limits: ArchiveLimits | None = None, out: IO[bytes] | None = None) -> Any:
        return self._receive("download_tar", {"sandbox_id": sandbox_id, "path": path, "limits": limits}, out)

    def open_shell(self, sandbox_id: str, cwd: str | None = None, env: dict[str, str] | None = None) -> Any:
        return self._invoke("open_shell", {"sandbox_id": sandbox_id, "cwd": cwd, "env": env}, decode_tagged)

    def shell_run(self, shell_id: str, cmd: str, timeout_s: float = 60.0, max_output_bytes: int = 1 << 20) -> Any:
        return self._invoke(
            "shell_run",
            {"shell_id": shell_id, "cmd": cmd, "timeout_s": timeout_s, "max_output_bytes": max_output_bytes},
            lambda r: from_jsonable(ExecResult, r),
        )

    def close_shell(self, shell_id: str) -> Any:
        return self._invoke("close_shell", {"shell_id": shell_id}, decode_tagged)

    def create_env(self, factory: str, kwargs: dict | None = None, pythonpath: list[str] | None = None, memory_bytes: int | None = None) -> Any:
        return self._invoke("create_env", {"factory": factory, "kwargs": kwargs, "pythonpath": pythonpath, "memory_bytes": memory_bytes}, decode_tagged)

    def call_env(self, env_id: str, method: str, args: list | None = None, kwargs: dict | None = None) -> Any:
        return self._invoke("call_env", {"env_id": env_id, "method": method, "args": args, "kwargs": kwargs}, decode_tagged)

    def snapshot(self, source_id: str, kind: str = "fs") -> Any:
        return self._invoke("snapshot", {"source_id": source_id, "kind": kind}, lambda r: from_jsonable(SnapshotInfo, r))

    def restore(self, target_id: str, snapshot_id: str) -> Any:
        return self._invoke("restore", {"target_id": target_id, "snapshot_id": snapshot_id}, decode_tagged)

    def fork(self, source_id: str, n: int) -> Any:
        return self._invoke("fork", {"source_id": source_id, "n": n}, list)

    def delete_snapshot(self, snapshot_id: str) -> Any:
        return self._invoke("delete_snapshot", {"snapshot_id": snapshot_id}, decode_tagged)

    def destroy(self, target_id: str) -> Any:
        return self._invoke("destroy", {"target_id": target_id}, decode_tagged)

    def stats(self, sandbox_id: str) -> Any:
        return self._invoke("stats", {"sandbox_id": sandbox_id}, lambda r: from_jsonable(SandboxStats, r))

    def heartbeat(self, sandbox_id: str, ttl_s: float | None = None) -> Any:
        return self._invoke("heartbeat", {"sandbox_id": sandbox_id, "ttl_s": ttl_s}, decode_tagged)

    def export_snapshot(self, snapshot_id: str, skip_layers: tuple[str, ...] = (), out: IO[bytes] | None = None) -> Any:
        return self._receive("export_snapshot", {"snapshot_id": snapshot_id, "skip_layers": list(skip_layers)}, out)

    def import_snapshot(self, data: Archive, limits: ArchiveLimits | None = None) -> Any:
        return self._send("import_snapshot", {"limits": limits}, data, lambda r: from_jsonable(SnapshotInfo, r))
