"""Terminal sessions (`pty_create` and friends): a command on a pty of the sandbox (namespace/terminal.py), its output kept in
a ring with offsets (ring.py), typed into and resized through its handle.

Each session runs on a thread of its own that copies the terminal's output into the ring until the command exits, is killed,
or reaches its deadline (default 1 h); then the ring is closed, so a reader that is told "no more" has every byte that was
kept. A restore of the sandbox kills its sessions and keeps their output readable; a destroy drops them. At most
`max_sessions` per daemon (the oldest ended one is dropped first, 503 Busy when all run).
"""

from __future__ import annotations

import dataclasses
import threading

from openk3.sandbox.api.handles import HandleTable
from openk3.sandbox.api.ring import OutputRing
from openk3.sandbox.namespace.backend import NamespaceBackend
from openk3.sandbox.namespace.terminal import Ended, Terminal
from openk3.sandbox.protocol import InvalidArgument
from openk3.sandbox.protocol_interactive import PtyOutput, PtyStatus

DEFAULT_COMMAND = ["/bin/bash", "-i", "-l"]
TERMINAL_ENV = {"TERM": "xterm-256color"}  # what E2B and Daytona terminals set; the sandbox's own TERM is "dumb"
MAX_SIZE = 4096  # rows and columns
MIN_BUFFER, MAX_BUFFER = 4 << 10, 16 << 20
MAX_WRITE_BYTES = 1 << 20
MAX_WAIT_S = 600.0


def check_wait(timeout_s: float, most: float = MAX_WAIT_S) -> None:
    if not 0 <= timeout_s <= most:
        raise InvalidArgument(f"timeout_s={timeout_s}: expected 0..{most:g}")


def check_size(rows: int, cols: int) -> None:
    if not (1 <= rows <= MAX_SIZE and 1 <= cols <= MAX_SIZE):
        raise InvalidArgument(f"rows={rows}, cols={cols}: expected 1..{MAX_SIZE} each")


def check_write(data: bytes, timeout_s: float) -> None:
    if len(data) > MAX_WRITE_BYTES:
        raise InvalidArgument(f"data: {len(data)} bytes; expected at most {MAX_WRITE_BYTES} per call")
    check_wait(timeout_s, 60.0)


@dataclasses.dataclass
class _Session:
    pty_id: str
    sandbox_id: str
    terminal: Terminal
    output: OutputRing
    rows: int
    cols: int
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    ended: Ended | None = None
    error: str | None = None
    killed: bool = False

    def finished(self) -> bool:
        return self.done.is_set()

    def stop(self, reason: str) -> None:
        if not self.done.is_set():
            self.killed = True
            self.terminal.stop()

    def join(self) -> None:
        self.done.wait()


class Terminals:
    def __init__(self, backend: NamespaceBackend, max_sessions: int = 256) -> None:
        self.backend = backend
        self.table: HandleTable[_Session] = HandleTable("pty_id", "pty-", max_sessions)

    def create(
        self,
        sandbox_id: str,
        cmd: str | list[str] | None = None,
        rows: int = 24,
        cols: int = 80,
        timeout_s: float = 3600.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        max_buffer_bytes: int = 1 << 20,
    ) -> str:
        check_size(rows, cols)
        if not MIN_BUFFER <= max_buffer_bytes <= MAX_BUFFER:
            raise InvalidArgument(f"max_buffer_bytes={max_buffer_bytes}: expected {MIN_BUFFER}..{MAX_BUFFER}")
        command = DEFAULT_COMMAND if cmd is None else cmd
        box = self.backend.check_exec(sandbox_id, command, timeout_s, cwd, env, 0)
        variables = {**TERMINAL_ENV, **(env or {})}

        def make(pty_id: str) -> _Session:
            session = _Session(pty_id, sandbox_id, Terminal(box, command, cwd, variables, rows, cols), OutputRing(max_buffer_bytes), rows, cols)

            def run() -> None:
                try:
                    session.ended = session.terminal.run(session.output.append, timeout_s)
                except Exception as e:  # a host failure: reported in the status rather than lost with the thread
                    session.error = f"internal error: {type(e).__name__}: {e}"
                finally:
                    session.output.close()
                    session.done.set()

            threading.Thread(target=run, name=f"sandbox-{pty_id}", daemon=True).start()
            return session

        return self.table.add(make)

    def write(self, pty_id: str, data: bytes, timeout_s: float = 10.0) -> int:
        """Type `data`; returns how many bytes went in (fewer than given only if the command stopped reading for `timeout_s`)."""
        check_write(data, timeout_s)
        return self.table.get(pty_id).terminal.write(data, timeout_s)

    def resize(self, pty_id: str, rows: int, cols: int) -> None:
        check_size(rows, cols)
        session = self.table.get(pty_id)
        session.terminal.resize(rows, cols)
        session.rows, session.cols = rows, cols

    def read(self, pty_id: str, offset: int = 0, max_bytes: int = 1 << 20, timeout_s: float = 0.0) -> PtyOutput:
        """Output from `offset`, waiting up to `timeout_s` for some when there is none yet; pass the returned offset back."""
        if offset < 0 or max_bytes < 1:
            raise InvalidArgument(f"offset={offset}, max_bytes={max_bytes}: expected offset >= 0, max_bytes >= 1")
        check_wait(timeout_s)
        got = self.table.get(pty_id).output.read(offset, max_bytes, timeout_s)
        return PtyOutput(data=got.data, offset=got.offset, skipped=got.skipped, more=got.more)

    def status(self, pty_id: str) -> PtyStatus:
        s = self.table.get(pty_id)
        ended = s.ended
        return PtyStatus(
            pty_id=s.pty_id,
            sandbox_id=s.sandbox_id,
            running=not s.done.is_set(),
            exit_code=None if ended is None else ended.exit_code,
            timed_out=ended is not None and ended.timed_out,
            killed=s.killed,
            rows=s.rows,
            cols=s.cols,
            output_bytes=s.output.end,
            error=s.error,
        )

    def wait(self, pty_id: str, timeout_s: float = 60.0) -> PtyStatus:
        check_wait(timeout_s)
        self.table.get(pty_id).done.wait(timeout_s)
        return self.status(pty_id)

    def kill(self, pty_id: str) -> PtyStatus:
        """End the session and everything it started; returns its final status."""
        session = self.table.get(pty_id)
        session.stop("killed")
        session.join()
        return self.status(pty_id)
