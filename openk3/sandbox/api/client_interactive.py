"""The interactive calls of both sandbox clients (client_methods.py builds on this table): stdin and signals of background
processes, terminal sessions and directory watches. Their streams (`pty_stream`, `watch_stream`) are in client.py, which
owns the transport."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from openk3.sandbox.protocol import decode_tagged, from_jsonable
from openk3.sandbox.protocol_interactive import PtyOutput, PtyStatus, watch_events_from


class InteractiveMethods:
    def _invoke(self, method: str, kwargs: dict[str, Any], convert: Callable[[Any], Any]) -> Any:
        raise NotImplementedError

    def process_write_stdin(self, process_id: str, data: bytes, timeout_s: float = 10.0) -> Any:
        """Bytes for the stdin of a process spawned with stdin=True; returns how many it took within `timeout_s`."""
        return self._invoke("process_write_stdin", {"process_id": process_id, "data": data, "timeout_s": timeout_s}, decode_tagged)

    def process_close_stdin(self, process_id: str) -> Any:
        return self._invoke("process_close_stdin", {"process_id": process_id}, decode_tagged)

    def process_signal(self, process_id: str, signal: int | str) -> Any:
        """Send `signal` (a number, or a name such as "SIGINT") to the background process's process group."""
        return self._invoke("process_signal", {"process_id": process_id, "signal": signal}, decode_tagged)

    def pty_create(
        self,
        sandbox_id: str,
        cmd: str | list[str] | None = None,
        rows: int = 24,
        cols: int = 80,
        timeout_s: float = 3600.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        max_buffer_bytes: int = 1 << 20,
    ) -> Any:
        """A terminal running `cmd` (default: a login bash); returns its pty_id."""
        args = {"sandbox_id": sandbox_id, "cmd": cmd, "rows": rows, "cols": cols, "timeout_s": timeout_s, "cwd": cwd, "env": env}
        return self._invoke("pty_create", {**args, "max_buffer_bytes": max_buffer_bytes}, decode_tagged)

    def pty_write(self, pty_id: str, data: bytes, timeout_s: float = 10.0) -> Any:
        """Type `data` into the terminal (b"\\x03" is Ctrl-C); returns how many bytes went in."""
        return self._invoke("pty_write", {"pty_id": pty_id, "data": data, "timeout_s": timeout_s}, decode_tagged)

    def pty_resize(self, pty_id: str, rows: int, cols: int) -> Any:
        return self._invoke("pty_resize", {"pty_id": pty_id, "rows": rows, "cols": cols}, decode_tagged)

    def pty_read(self, pty_id: str, offset: int = 0, max_bytes: int = 1 << 20, timeout_s: float = 0.0) -> Any:
        """Output from `offset` (waiting up to `timeout_s` for some); pass the returned offset back for what follows."""
        args = {"pty_id": pty_id, "offset": offset, "max_bytes": max_bytes, "timeout_s": timeout_s}
        return self._invoke("pty_read", args, lambda r: from_jsonable(PtyOutput, r))

    def pty_status(self, pty_id: str) -> Any:
        return self._invoke("pty_status", {"pty_id": pty_id}, lambda r: from_jsonable(PtyStatus, r))

    def pty_wait(self, pty_id: str, timeout_s: float = 60.0) -> Any:
        return self._invoke("pty_wait", {"pty_id": pty_id, "timeout_s": timeout_s}, lambda r: from_jsonable(PtyStatus, r))

    def pty_kill(self, pty_id: str) -> Any:
        return self._invoke("pty_kill", {"pty_id": pty_id}, lambda r: from_jsonable(PtyStatus, r))

    def watch_dir(self, sandbox_id: str, path: str, recursive: bool = True, max_events: int = 4096, max_dirs: int = 1024) -> Any:
        """Watch a directory of the sandbox (and its subdirectories when `recursive`); returns its watch_id."""
        args = {"sandbox_id": sandbox_id, "path": path, "recursive": recursive, "max_events": max_events, "max_dirs": max_dirs}
        return self._invoke("watch_dir", args, decode_tagged)

    def watch_events(self, watch_id: str, timeout_s: float = 0.0, max_events: int = 4096) -> Any:
        """Events queued since the last call (waiting up to `timeout_s` for one), each returned once."""
        return self._invoke("watch_events", {"watch_id": watch_id, "timeout_s": timeout_s, "max_events": max_events}, watch_events_from)

    def watch_stop(self, watch_id: str) -> Any:
        return self._invoke("watch_stop", {"watch_id": watch_id}, decode_tagged)
