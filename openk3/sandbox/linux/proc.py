"""Running a command started through openk3-enter (helper.py) and collecting its output under a deadline and a byte cap.

The command line comes from `Helper.enter_argv`: one static host program joins the sandbox's cgroups (so everything the
command becomes and forks is accounted, limited and killable before any user code runs), its namespaces and root, drops every
capability, loads the seccomp filter and execs the command with the caller's environment; the host side of this runs with
`helper.HOST_ENV` only.
"""

from __future__ import annotations

import dataclasses
import os
import select
import selectors
import subprocess
import threading
import time
from collections.abc import Callable

DRAIN_GRACE_S = 0.02  # after the command exits, how long background holders of its pipes may keep us reading


def shell_quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


@dataclasses.dataclass(frozen=True)
class Captured:
    returncode: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    truncated: bool
    duration_ms: float
    stopped: bool = False  # ended early because the caller set `stop`


# Streamed output (exec_stream, background processes): called with ("stdout" | "stderr", chunk) as each chunk arrives, within
# the byte cap, instead of collecting it; it runs on the reading thread, so a slow consumer slows the command, never the host.
OnOutput = Callable[[str, bytes], None]


def exit_status(returncode: int) -> int:
    """Popen's -N (killed by signal N) as the shell's 128+N, so an OOM kill reads as 137."""
    return 128 - returncode if returncode < 0 else returncode


def _wait_exit(pid: int, deadline: float) -> bool:
    """Wait for `pid` to exit until `deadline` without Popen.wait's polling (it sleeps up to 50 ms between checks)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([pidfd], [], [], max(0.0, deadline - time.monotonic()))[0])
    finally:
        os.close(pidfd)


def run_captured(
    argv: list[str],
    env: dict[str, str],
    stdin: bytes | int | None,
    timeout_s: float,
    max_output_bytes: int,
    on_timeout: Callable[[], None],
    pass_fds: tuple[int, ...] = (),
    stdout_fd: int | None = None,
    on_output: OnOutput | None = None,
    stop: threading.Event | None = None,
    on_start: Callable[[int], None] | None = None,
) -> Captured:
    """Run argv, feed stdin, keep at most `max_output_bytes` of each stream; at the deadline call `on_timeout` (kill the tree).

    The caller's `on_timeout` must kill every process that may hold the pipes, which the cgroup kill does; output beyond the
    cap is read and dropped so a chatty command cannot block on a full pipe. `stdin` as an int and `stdout_fd` are descriptors
    the command reads or writes directly (archives streamed by another thread, never held here); the caller closes them.
    With `on_output`, chunks go to it instead of the result; `stop` set by another thread ends the command as a deadline
    would (seen within one 50 ms wait). `on_start` gets the helper's pid as soon as it runs, before anything here can reap
    it (a pidfd opened there is certain to be the helper's).
    """
    start = time.monotonic()
    deadline = start + timeout_s
    # A session of its own for the helper, as for every process the daemon starts for a sandbox (see helper_source.py).
    proc = subprocess.Popen(
        argv,
        stdin=stdin if isinstance(stdin, int) else subprocess.PIPE,
        stdout=subprocess.PIPE if stdout_fd is None else stdout_fd,
        stderr=subprocess.PIPE,
        env=env,
        close_fds=True,
        pass_fds=pass_fds,
        start_new_session=True,
    )
    if on_start is not None:
        on_start(proc.pid)
    assert proc.stderr is not None
    out_fd, err_fd = (-1 if proc.stdout is None else proc.stdout.fileno()), proc.stderr.fileno()
    bufs = {fd: bytearray() for fd in (out_fd, err_fd) if fd >= 0}
    names = {out_fd: "stdout", err_fd: "stderr"}
    sent = dict.fromkeys(bufs, 0)
    truncated = False
    timed_out = False
    stopped = False
    killed = False
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    pending = memoryview(b"" if isinstance(stdin, int) else stdin or b"")
    in_fd = -1 if proc.stdin is None else proc.stdin.fileno()
    if pending and proc.stdin is not None:
        os.set_blocking(in_fd, False)
        sel.register(in_fd, selectors.EVENT_WRITE)
    elif proc.stdin is not None:
        proc.stdin.close()
    exited_at: float | None = None
    try:
        while sel.get_map():
            now = time.monotonic()
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > DRAIN_GRACE_S:
                break
            if stop is not None and stop.is_set() and not killed:
                stopped = True
                deadline = now
            if now >= deadline and not killed:
                killed = True
                timed_out = not stopped
                # The helper too, first: a deadline that passes before it has joined the command's cgroup (a tiny
                # timeout_s) would leave it to start the command after the cgroup kill, with nobody to stop it.
                proc.kill()
                on_timeout()
                # Killed processes release the pipes at once; give the kernel a moment, then stop waiting.
                deadline = now + 0.05
                exited_at = exited_at or now
            elif killed and now >= deadline:
                break
            wait = min(deadline - now, 0.005 if exited_at is not None else 0.05)
            for key, _ in sel.select(max(wait, 0.0)):
                fd = key.fd
                if fd == in_fd:
                    try:
                        pending = pending[os.write(fd, pending[: 1 << 16]) :]
                    except BrokenPipeError:
                        pending = memoryview(b"")
                    if not pending and proc.stdin is not None:
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    sel.unregister(fd)
                    continue
                room = max_output_bytes - (sent[fd] if on_output is not None else len(bufs[fd]))
                if len(chunk) > room:
                    truncated = True
                chunk = chunk[:room] if room > 0 else b""
                if on_output is None:
                    bufs[fd] += chunk
                elif chunk:
                    sent[fd] += len(chunk)
                    on_output(names[fd], chunk)
    finally:
        sel.close()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if f is not None and not f.closed:
                f.close()
    # It may have closed both pipes and kept running (e.g. `exec >&-`): the deadline and `stop` still hold.
    while proc.poll() is None and not killed:
        if stop is not None and stop.is_set():
            stopped = True
        elif time.monotonic() < deadline and not _wait_exit(proc.pid, min(deadline, time.monotonic() + 0.05)):
            continue
        elif proc.poll() is None:
            timed_out = True
        if proc.poll() is None:
            killed = True
            proc.kill()
            on_timeout()
    returncode = proc.wait()
    return Captured(
        returncode=exit_status(returncode),
        stdout=bytes(bufs.get(out_fd, b"")),
        stderr=bytes(bufs[err_fd]),
        timed_out=timed_out,
        truncated=truncated,
        duration_ms=(time.monotonic() - start) * 1000,
        stopped=stopped,
    )
