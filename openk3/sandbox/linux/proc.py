"""Starting processes inside a sandbox and collecting their output under a deadline and a byte cap.

A command enters the sandbox in four hops, each an exec: a host `/bin/sh` that writes its own pid into the sandbox's
cgroups (so everything it becomes and forks is accounted, limited and killable before any user code runs), `nsenter` into the
init's user, mount, pid, net, ipc, uts and cgroup namespaces and root, and the sandbox's `setpriv`, which clears the capability
bounding and inheritable sets so the command holds no capability even inside its own user namespace (the same as the init,
which bwrap starts without capabilities), then the command, which changes to its working directory itself (nsenter's
--wd would resolve the directory on the host).
"""

from __future__ import annotations

import dataclasses
import os
import select
import selectors
import subprocess
import time
from collections.abc import Callable

JOIN_CGROUPS = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
DRAIN_GRACE_S = 0.02  # after the command exits, how long background holders of its pipes may keep us reading


def cgroup_trampoline(procs_files: list[str]) -> list[str]:
    return ["/bin/sh", "-c", JOIN_CGROUPS, "sh", *procs_files, "--"]


def enter_argv(init_pid: int) -> list[str]:
    return [
        "nsenter",
        "-t",
        str(init_pid),
        "-U",
        "-m",
        "-p",
        "-n",
        "-i",
        "-u",
        "-C",
        "-r",
        "-w",
        "--",
        "/usr/bin/setpriv",
        "--bounding-set=-all",
        "--inh-caps=-all",
        "--",
    ]


def command_argv(cmd: str | list[str], cwd: str) -> list[str]:
    """The command itself, started in `cwd` (a shell string runs under /bin/sh, an argv list directly)."""
    if isinstance(cmd, str):
        return ["/bin/sh", "-c", f"cd {shell_quote(cwd)} || exit 1\n{cmd}"]
    return ["/usr/bin/env", f"--chdir={cwd}", "--", *cmd]


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
    stdin: bytes | None,
    timeout_s: float,
    max_output_bytes: int,
    on_timeout: Callable[[], None],
) -> Captured:
    """Run argv, feed stdin, keep at most `max_output_bytes` of each stream; at the deadline call `on_timeout` (kill the tree).

    The caller's `on_timeout` must kill every process that may hold the pipes, which the cgroup kill does; output beyond the
    cap is read and dropped so a chatty command cannot block on a full pipe.
    """
    start = time.monotonic()
    deadline = start + timeout_s
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, close_fds=True)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    bufs = {out_fd: bytearray(), err_fd: bytearray()}
    truncated = False
    timed_out = False
    sel = selectors.DefaultSelector()
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    pending = memoryview(stdin or b"")
    in_fd = proc.stdin.fileno()
    if pending:
        os.set_blocking(in_fd, False)
        sel.register(in_fd, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    exited_at: float | None = None
    try:
        while sel.get_map():
            now = time.monotonic()
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > DRAIN_GRACE_S:
                break
            if now >= deadline and not timed_out:
                timed_out = True
                on_timeout()
                # Killed processes release the pipes at once; give the kernel a moment, then stop waiting.
                deadline = now + 0.05
                exited_at = exited_at or now
            elif timed_out and now >= deadline:
                break
            wait = min(deadline - now, 0.005 if exited_at is not None else 0.05)
            for key, _ in sel.select(max(wait, 0.0)):
                fd = key.fd
                if fd == in_fd:
                    try:
                        pending = pending[os.write(fd, pending[: 1 << 16]) :]
                    except BrokenPipeError:
                        pending = memoryview(b"")
                    if not pending:
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    sel.unregister(fd)
                    continue
                room = max_output_bytes - len(bufs[fd])
                if len(chunk) > room:
                    truncated = True
                bufs[fd] += chunk[:room] if room > 0 else b""
    finally:
        sel.close()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            if not f.closed:
                f.close()
    if proc.poll() is None and not _wait_exit(proc.pid, deadline):
        # It closed both pipes but kept running (e.g. `exec >&-`): the deadline still holds.
        timed_out = True
        on_timeout()
    returncode = proc.wait()
    return Captured(
        returncode=exit_status(returncode),
        stdout=bytes(bufs[out_fd]),
        stderr=bytes(bufs[err_fd]),
        timed_out=timed_out,
        truncated=truncated,
        duration_ms=(time.monotonic() - start) * 1000,
    )
