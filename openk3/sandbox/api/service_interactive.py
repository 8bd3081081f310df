"""The interactive calls of SandboxService (service.py): terminal sessions (terminals.py), directory watches (watches.py), and
stdin and signals of background processes (background.py). Each handle belongs to one sandbox and is reached by its id only;
a restore of the sandbox ends its terminals and watches (what they produced stays readable), a destroy drops them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

import pydantic

from openk3.sandbox.api.background import BackgroundProcesses
from openk3.sandbox.api.terminals import Terminals
from openk3.sandbox.api.watches import Watches
from openk3.sandbox.protocol_interactive import PtyOutput, PtyStatus, WatchEvent, WatchEvents

# Strict: JSON `true` must be refused, not sent as signal 1 (pydantic's lax mode reads a bool as an int).
SignalArg = Annotated[int, pydantic.Strict()] | str
STREAM_POLL_S = 5.0  # how long one step of a stream waits for news before it checks that its client is still there


class InteractiveCalls:
    background: BackgroundProcesses
    terminals: Terminals
    watches: Watches

    # stdin and signals of background processes
    def process_write_stdin(self, process_id: str, data: bytes, timeout_s: float = 10.0) -> int:
        """Write to the stdin of a process spawned with stdin=True; returns the bytes taken within `timeout_s`."""
        return self.background.write_stdin(process_id, data, timeout_s)

    def process_close_stdin(self, process_id: str) -> None:
        self.background.close_stdin(process_id)

    def process_signal(self, process_id: str, signal: SignalArg) -> None:
        """Send `signal` (a number or a name such as "SIGINT") to the process group of a background process."""
        self.background.signal(process_id, signal)

    # terminal sessions
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
    ) -> str:
        """Start `cmd` (default: a login bash) on a new terminal of the sandbox; returns its pty_id."""
        return self.terminals.create(sandbox_id, cmd, rows, cols, timeout_s, cwd, env, max_buffer_bytes)

    def pty_write(self, pty_id: str, data: bytes, timeout_s: float = 10.0) -> int:
        return self.terminals.write(pty_id, data, timeout_s)

    def pty_resize(self, pty_id: str, rows: int, cols: int) -> None:
        self.terminals.resize(pty_id, rows, cols)

    def pty_read(self, pty_id: str, offset: int = 0, max_bytes: int = 1 << 20, timeout_s: float = 0.0) -> PtyOutput:
        return self.terminals.read(pty_id, offset, max_bytes, timeout_s)

    def pty_stream(self, pty_id: str, offset: int = 0, max_bytes: int = 1 << 16) -> Iterator[PtyOutput | None]:
        """Output from `offset` as it comes, ending with the terminal; None items are quiet polls (the server checks its
        client then). Arguments are checked before the first item."""
        self.terminals.read(pty_id, offset, max_bytes, 0.0)

        def items() -> Iterator[PtyOutput | None]:
            at = offset
            while True:
                got = self.terminals.read(pty_id, at, max_bytes, STREAM_POLL_S)
                at = got.offset
                yield got if got.data or got.skipped or not got.more else None
                if not got.more:
                    return

        return items()

    def pty_status(self, pty_id: str) -> PtyStatus:
        return self.terminals.status(pty_id)

    def pty_wait(self, pty_id: str, timeout_s: float = 60.0) -> PtyStatus:
        return self.terminals.wait(pty_id, timeout_s)

    def pty_kill(self, pty_id: str) -> PtyStatus:
        return self.terminals.kill(pty_id)

    # directory watches
    def watch_dir(self, sandbox_id: str, path: str, recursive: bool = True, max_events: int = 4096, max_dirs: int = 1024) -> str:
        """Watch `path` (a directory of the sandbox, and its subdirectories when `recursive`); returns its watch_id."""
        return self.watches.watch_dir(sandbox_id, path, recursive, max_events, max_dirs)

    def watch_events(self, watch_id: str, timeout_s: float = 0.0, max_events: int = 4096) -> WatchEvents:
        return self.watches.events(watch_id, timeout_s, max_events)

    def watch_stream(self, watch_id: str) -> Iterator[WatchEvent | None]:
        """Events as they come, ending with the watch; None items are quiet polls. The watch is checked before the first."""
        self.watches.table.get(watch_id)

        def items() -> Iterator[WatchEvent | None]:
            while True:
                got = self.watches.events(watch_id, STREAM_POLL_S)
                yield from got.events
                if not got.events:
                    yield None
                if not got.active:
                    return

        return items()

    def watch_stop(self, watch_id: str) -> None:
        self.watches.stop(watch_id)

    def _end_interactive(self, sandbox_id: str, forget: bool) -> None:
        """End the sandbox's terminals and watches (its restore, or with `forget` its destroy)."""
        self.terminals.table.end_sandbox(sandbox_id, "its sandbox was destroyed" if forget else "its sandbox was restored", forget)
        self.watches.table.end_sandbox(sandbox_id, "its sandbox was destroyed" if forget else "its sandbox was restored", forget)
