"""ProcessInput: the stdin pipe and the signals of one background process (background.py), addressed by its handle only.

Why by handle: the daemon signals only a command it started itself, found through the helper it spawned (linux/signals.py
proves the find with pidfds), so no caller-chosen pid, and no pid the sandbox could recycle, is ever signalled. Stdin is a
pipe whose write end the daemon keeps non-blocking: a command that stops reading makes a write return short after its
timeout instead of holding a worker, and the pipe's own buffer (64 KiB) bounds what the daemon holds for it.

Contract: the lock guards the write end and the helper's pidfd; `close` (when the command has ended) releases both, and every
later call answers 409 Conflict.
"""

from __future__ import annotations

import os
import threading
import time

from openk3.sandbox.linux import signals
from openk3.sandbox.linux.nonblocking import write_within
from openk3.sandbox.protocol import Conflict

START_WAIT_S = 10.0  # how long a signal waits for a command that is still entering its sandbox


class ProcessInput:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writer: int | None = None
        self._has_stdin = False
        self._ended = False
        self._helper: tuple[int, int] | None = None  # (pid, pidfd) of the openk3-enter helper running the command

    def open_stdin(self) -> int:
        """The read end of a new stdin pipe for the command (the caller passes it on, then closes it)."""
        reader, writer = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(writer, False)
        with self._lock:
            self._writer, self._has_stdin = writer, True
        return reader

    def started(self, helper_pid: int) -> None:
        """The helper runs as `helper_pid`, the daemon's child not yet reaped, so a pidfd opened now is certain to be its."""
        pidfd = os.pidfd_open(helper_pid)
        with self._lock:
            if self._helper is not None:  # a retried start (its sandbox's init was replaced): the first helper has exited
                os.close(self._helper[1])
            self._helper = (helper_pid, pidfd)

    def _writer_copy(self, process_id: str) -> int:
        with self._lock:
            if self._ended:
                raise Conflict(f"process_id={process_id!r}: the process has ended")
            if not self._has_stdin:
                raise Conflict(f"process_id={process_id!r}: spawned without stdin=True, its stdin is empty")
            if self._writer is None:
                raise Conflict(f"process_id={process_id!r}: its stdin was closed")
            return os.dup(self._writer)  # our own reference: close_stdin may close the pipe meanwhile

    def write(self, process_id: str, data: bytes, timeout_s: float) -> int:
        """Write `data` to the command's stdin; returns how much went in before `timeout_s`."""
        fd = self._writer_copy(process_id)
        try:
            return write_within(fd, data, timeout_s)
        except BrokenPipeError as e:
            raise Conflict(f"process_id={process_id!r}: nothing reads its stdin any more (the command closed it or exited)") from e
        finally:
            os.close(fd)

    def close_stdin(self, process_id: str) -> None:
        """End of input: the command reads EOF after what was written."""
        with self._lock:
            if not self._has_stdin:
                raise Conflict(f"process_id={process_id!r}: spawned without stdin=True, its stdin is empty")
            if self._writer is not None:
                os.close(self._writer)
                self._writer = None

    def signal(self, process_id: str, signal: int | str, done: threading.Event) -> None:
        """Send `signal` to the command's process group (linux/signals.py). A command still entering its sandbox is waited
        for (up to START_WAIT_S), so a signal right after spawn is not lost; one that has ended answers 409."""
        number = signals.parse(signal)
        deadline = time.monotonic() + START_WAIT_S
        while (command := self._command(process_id, done)) is None:
            if time.monotonic() >= deadline:
                raise Conflict(f"process_id={process_id!r}: the command did not start within {START_WAIT_S:g} s; check its status")
            done.wait(0.01)
        try:
            signals.send_to_group(command, number)
        except ProcessLookupError as e:
            raise Conflict(f"process_id={process_id!r}: the command exited before the signal") from e
        finally:
            os.close(command)

    def _command(self, process_id: str, done: threading.Event) -> int | None:
        """A pidfd of the running command, None while it is still starting; 409 once it has ended."""
        with self._lock:
            if self._ended or done.is_set():
                raise Conflict(f"process_id={process_id!r}: the process has ended")
            return None if self._helper is None else signals.command_pidfd(self._helper[1], self._helper[0])

    def close(self) -> None:
        """The command has ended: release the pipe and the helper's pidfd."""
        with self._lock:
            self._ended = True
            if self._writer is not None:
                os.close(self._writer)
                self._writer = None
            if self._helper is not None:
                os.close(self._helper[1])
                self._helper = None
