"""An in-memory stand-in for openk3's sandboxes (rl/tools.py Sandboxes) for episode tests that need no namespaces: each
sandbox is a dict of files; a command is `write KEY VALUE`, `read KEY` or `wait NAME` (blocks its worker thread until the
test sets the event NAME, the way a slow tool would). Snapshots copy the files; forks copy the snapshot."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

from openk3.sandbox.protocol import ExecResult, SandboxError, SnapshotInfo, SnapshotKind

WAIT_LIMIT_S = 60.0  # a `wait` no one releases fails the test as a timed-out tool, instead of hanging it


class FakeSandboxes:
    def __init__(self) -> None:
        self.files: dict[str, dict[str, str]] = {}
        self.snapshots: dict[str, dict[str, str]] = {}
        self.events: dict[str, threading.Event] = {}
        self.log: list[tuple[str, str]] = []  # (sandbox id, command), in the order they ran
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def create(self, *args: Any, **kwargs: Any) -> str:
        sid = f"sb{next(self._ids)}"
        self.files[sid] = {}
        return sid

    def event(self, name: str) -> threading.Event:
        with self._lock:
            return self.events.setdefault(name, threading.Event())

    def exec(self, sandbox_id: str, cmd: str | list[str], timeout_s: float = 60.0) -> ExecResult:
        if sandbox_id not in self.files:
            raise SandboxError(f"no sandbox {sandbox_id}")
        words = (cmd if isinstance(cmd, str) else " ".join(cmd)).split()
        with self._lock:
            self.log.append((sandbox_id, " ".join(words)))
        files = self.files[sandbox_id]
        if words[:1] == ["write"] and len(words) == 3:
            files[words[1]] = words[2]
            return _result(0, b"")
        if words[:1] == ["read"] and len(words) == 2:
            value = files.get(words[1])
            return _result(0, value.encode()) if value is not None else _result(1, b"", b"no such file")
        if words[:1] == ["wait"] and len(words) == 2:
            released = self.event(words[1]).wait(WAIT_LIMIT_S)
            return _result(0, b"released") if released else _result(124, b"", timed_out=True)
        if words[:1] == ["refuse"]:
            raise SandboxError("refused")
        return _result(127, b"", b"unknown command")

    def snapshot(self, source_id: str) -> SnapshotInfo:
        snapshot_id = f"snap{next(self._ids)}"
        self.snapshots[snapshot_id] = dict(self.files[source_id])
        return SnapshotInfo(snapshot_id, SnapshotKind.FS, (), source_id, time.time(), "files")

    def fork(self, source_id: str, n: int) -> list[str]:
        out = []
        for _ in range(n):
            sid = self.create()
            self.files[sid] = dict(self.snapshots[source_id])
            out.append(sid)
        return out

    def destroy(self, target_id: str) -> None:
        del self.files[target_id]

    def delete_snapshot(self, snapshot_id: str) -> None:
        del self.snapshots[snapshot_id]


def _result(code: int, out: bytes, err: bytes = b"", timed_out: bool = False) -> ExecResult:
    return ExecResult(code, out, err, timed_out, False, 0.0, False)
