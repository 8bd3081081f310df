"""Background processes: a command started in a sandbox that outlives the call starting it, with a handle to poll, read and kill.

Each runs as an ordinary exec (its own cgroup leaf, the same deadline and byte cap) on a thread of its own, with its output
appended to two streams as it arrives; `output` reads them from the offsets the caller passes back, so a poller gets each
byte once. What all handles keep is bounded by one daemon-wide budget (output_budget.py): past it the largest streams drop
their oldest bytes, and status and output say how many. `kill` ends the command's whole tree (the leaf's cgroup kill, as at
a deadline) and waits for it. Handles live until their sandbox is destroyed; at `max_processes` the oldest finished one is
dropped, and when none has finished a new spawn is refused (503 Busy).

Contract: the table's lock guards the dict of handles, each handle's lock its result, the budget's lock every stream; the
exec thread is the only writer of a handle. Its stdin and signals go through `io` (background_input.py), which has a lock
of its own.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import uuid

from openk3.sandbox.api.background_input import ProcessInput
from openk3.sandbox.api.output_budget import DEFAULT_OUTPUT_BUDGET, OutputBudget, Stream
from openk3.sandbox.namespace.backend import NamespaceBackend
from openk3.sandbox.protocol import Busy, ExecResult, InvalidArgument, NotFound, ProcessOutput, ProcessStatus, SandboxError

MAX_OUTPUT_BYTES = 64 << 20
MAX_STDIN_WRITE = 1 << 20  # per write_stdin call: a request body the daemon holds whole


@dataclasses.dataclass
class _Handle:
    process_id: str
    sandbox_id: str
    out: Stream
    err: Stream
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    result: ExecResult | None = None
    error: str | None = None
    io: ProcessInput = dataclasses.field(default_factory=ProcessInput)


class BackgroundProcesses:
    def __init__(self, backend: NamespaceBackend, max_processes: int = 1024, output_budget_bytes: int = DEFAULT_OUTPUT_BUDGET) -> None:
        self.backend = backend
        self.max_processes = max_processes
        self.budget = OutputBudget(output_budget_bytes)
        self._lock = threading.Lock()
        self._handles: dict[str, _Handle] = {}

    def _make_room(self) -> None:
        with self._lock:
            if len(self._handles) < self.max_processes:
                return
            finished = [h for h in self._handles.values() if h.done.is_set()]
            if not finished:
                raise Busy(f"{self.max_processes} background processes are running; kill some or retry later")
            gone = self._handles.pop(finished[0].process_id)  # dicts keep insertion order: the oldest
        self.budget.release(gone.out, gone.err)

    def spawn(
        self,
        sandbox_id: str,
        cmd: str | list[str],
        timeout_s: float = 3600.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        max_output_bytes: int = 16 << 20,
        stdin: bool = False,
    ) -> str:
        """Start `cmd` and return its process id at once; arguments are checked as exec checks them, before it starts. With
        `stdin`, its stdin is a pipe the caller writes with `write_stdin` and ends with `close_stdin`; else it reads EOF."""
        if max_output_bytes > MAX_OUTPUT_BYTES:
            # The daemon keeps this much per stream until the handle goes: what a sandbox prints must not be able to fill it.
            raise InvalidArgument(f"max_output_bytes={max_output_bytes}: expected <= {MAX_OUTPUT_BYTES} for a background process")
        self.backend.check_exec(sandbox_id, cmd, timeout_s, cwd, env, max_output_bytes)
        self._make_room()
        handle = _Handle(process_id=f"bg-{uuid.uuid4().hex[:12]}", sandbox_id=sandbox_id, out=self.budget.stream(), err=self.budget.stream())
        reader = handle.io.open_stdin() if stdin else None

        def on_output(stream: str, chunk: bytes) -> None:
            self.budget.append(handle.out if stream == "stdout" else handle.err, chunk)

        def run() -> None:
            try:
                handle.result = self.backend.exec(
                    sandbox_id, cmd, timeout_s, cwd, env, reader, max_output_bytes, on_output=on_output, stop=handle.stop, on_start=handle.io.started
                )
            except SandboxError as e:  # its sandbox was destroyed or restored under it, or its init could not start
                handle.error = str(e)
            except Exception as e:  # a host failure: reported in the status rather than lost with the thread
                handle.error = f"internal error: {type(e).__name__}: {e}"
            finally:
                if reader is not None:
                    os.close(reader)
                handle.io.close()
                handle.done.set()

        with self._lock:
            self._handles[handle.process_id] = handle
        threading.Thread(target=run, name=f"sandbox-{handle.process_id}", daemon=True).start()
        return handle.process_id

    def _handle(self, process_id: str) -> _Handle:
        with self._lock:
            if process_id not in self._handles:
                raise NotFound(f"process_id={process_id!r}: no such background process")
            return self._handles[process_id]

    def sandbox_of(self, process_id: str) -> str:
        """The sandbox a handle belongs to (what its owner is derived from, see tenant_view.py)."""
        return self._handle(process_id).sandbox_id

    def status(self, process_id: str) -> ProcessStatus:
        h = self._handle(process_id)
        (out_start, out_end), (err_start, err_end) = self.budget.offsets(h.out), self.budget.offsets(h.err)
        with h.lock:
            r = h.result
            return ProcessStatus(
                process_id=h.process_id,
                sandbox_id=h.sandbox_id,
                running=not h.done.is_set(),
                exit_code=None if r is None else r.exit_code,
                timed_out=r is not None and r.timed_out,
                killed=h.stop.is_set(),
                oom_killed=r is not None and r.oom_killed,
                stdout_bytes=out_end,
                stderr_bytes=err_end,
                truncated=r is not None and r.truncated,
                error=h.error,
                stdout_dropped=out_start,
                stderr_dropped=err_start,
            )

    def output(self, process_id: str, stdout_offset: int = 0, stderr_offset: int = 0, max_bytes: int = 1 << 20) -> ProcessOutput:
        """Up to `max_bytes` of each stream from the given offsets, or from the first byte still kept when the budget dropped
        those (`*_dropped` says how many bytes were skipped); the returned offsets are where the next call starts."""
        if stdout_offset < 0 or stderr_offset < 0 or max_bytes < 1:
            raise InvalidArgument(f"stdout_offset={stdout_offset}, stderr_offset={stderr_offset}, max_bytes={max_bytes}: expected offsets >= 0, max_bytes >= 1")
        h = self._handle(process_id)
        running = not h.done.is_set()  # read before the bytes: a "not running" answer has seen all of them
        out_skipped, out = self.budget.read(h.out, stdout_offset, max_bytes)
        err_skipped, err = self.budget.read(h.err, stderr_offset, max_bytes)
        return ProcessOutput(
            stdout=out,
            stderr=err,
            stdout_offset=stdout_offset + out_skipped + len(out),
            stderr_offset=stderr_offset + err_skipped + len(err),
            running=running,
            stdout_dropped=out_skipped,
            stderr_dropped=err_skipped,
        )

    def kill(self, process_id: str) -> ProcessStatus:
        """End the process and everything it started; returns its final status."""
        h = self._handle(process_id)
        h.stop.set()
        h.done.wait()
        return self.status(process_id)

    def write_stdin(self, process_id: str, data: bytes, timeout_s: float = 10.0) -> int:
        """Bytes for the command's stdin (spawned with stdin=True); returns how many went in within `timeout_s`."""
        if len(data) > MAX_STDIN_WRITE:
            raise InvalidArgument(f"data: {len(data)} bytes; expected at most {MAX_STDIN_WRITE} per call")
        if not 0 <= timeout_s <= 60:
            raise InvalidArgument(f"timeout_s={timeout_s}: expected 0..60")
        return self._handle(process_id).io.write(process_id, data, timeout_s)

    def close_stdin(self, process_id: str) -> None:
        """End the command's stdin: it reads EOF once it has read what was written."""
        self._handle(process_id).io.close_stdin(process_id)

    def signal(self, process_id: str, signal: int | str) -> None:
        """Send `signal` (a number or a name) to the command's process group inside the sandbox (background_input.py)."""
        h = self._handle(process_id)
        h.io.signal(process_id, signal, h.done)

    def wait(self, process_id: str, timeout_s: float) -> ProcessStatus:
        """Its status once it has ended or `timeout_s` passed, whichever comes first."""
        if not 0 <= timeout_s <= 600:
            raise InvalidArgument(f"timeout_s={timeout_s}: expected 0..600")
        self._handle(process_id).done.wait(timeout_s)
        return self.status(process_id)

    def forget_sandbox(self, sandbox_id: str) -> None:
        """Kill a sandbox's background processes and drop their handles (its destroy)."""
        with self._lock:
            doomed = [h for h in self._handles.values() if h.sandbox_id == sandbox_id]
        for h in doomed:
            h.stop.set()
        for h in doomed:
            h.done.wait()
        with self._lock:
            for h in doomed:
                self._handles.pop(h.process_id, None)
        for h in doomed:
            self.budget.release(h.out, h.err)

    def stop_sandbox(self, sandbox_id: str) -> None:
        """Kill a sandbox's background processes, keeping their handles (its restore: the output stays readable)."""
        with self._lock:
            running = [h for h in self._handles.values() if h.sandbox_id == sandbox_id and not h.done.is_set()]
        for h in running:
            h.stop.set()
        for h in running:
            h.done.wait()

    def ids(self) -> list[str]:
        with self._lock:
            return sorted(self._handles)

    def running_count(self) -> int:
        with self._lock:
            return sum(not h.done.is_set() for h in self._handles.values())

    def close(self) -> None:
        with self._lock:
            sandboxes = {h.sandbox_id for h in self._handles.values()}
        for sid in sandboxes:
            self.forget_sandbox(sid)
