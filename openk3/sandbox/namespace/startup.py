"""Waiting for a sandbox's init to come up, when what it prints is the sandbox's to choose.

After a restore, or when a dead init is restarted over the same files, bwrap runs the sandbox's own `/bin/bash` with its own
libraries: a planted `/etc/ld.so.preload` or a replaced bash may print without end (the daemon would buffer all of it) or
print nothing and never exit (a worker thread would wait forever). So the init's output and bwrap's info pipe are read
together under one deadline and one byte cap, and the pid bwrap reports is pinned with a pidfd only once it is known to be
bwrap's child, so a pid reused between bwrap's report and the pidfd cannot be mistaken for the init.
"""

from __future__ import annotations

import json
import os
import select
import signal
import time

READY = b"ready\n"
MAX_OUTPUT_BYTES = 64 << 10  # ld.so warnings before "ready" are a few hundred bytes; anything near this is an attack or a bug
MAX_INFO_BYTES = 4096  # bwrap's --info-fd JSON is one short object


class StartupError(Exception):
    """The init did not come up; the message says why and shows (the start of) what it printed."""


def _said(out: bytes | bytearray) -> str:
    return out[:2000].decode(errors="replace").strip()


def wait_ready(out_fd: int, info_fd: int, timeout_s: float) -> int:
    """The init's pid (bwrap's `child-pid`) once the init printed a line `ready` and bwrap closed its info pipe.

    Lines before `ready` are noise the sandbox's tree may cause. Raises StartupError at the deadline, past the byte caps, or
    when the output ends without `ready`. Neither descriptor is closed here.
    """
    deadline = time.monotonic() + timeout_s
    out, info = bytearray(), bytearray()
    poll = select.poll()
    for fd in (out_fd, info_fd):
        os.set_blocking(fd, False)
        poll.register(fd, select.POLLIN)
    open_fds = {out_fd, info_fd}
    while True:
        if (b"\n" + out).find(b"\n" + READY) >= 0:
            if out_fd in open_fds:
                poll.unregister(out_fd)  # what it prints after "ready" is not ours to read
                open_fds.discard(out_fd)
            if info_fd not in open_fds:
                break
        elif out_fd not in open_fds:
            raise StartupError(f"init exited before it was ready: {_said(out)!r}")
        left = deadline - time.monotonic()
        if left <= 0:
            raise StartupError(f"init did not say ready within {timeout_s:g} s: {_said(out)!r}")
        for fd, _ in poll.poll(left * 1000):
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                poll.unregister(fd)
                open_fds.discard(fd)
                continue
            buf, cap = (out, MAX_OUTPUT_BYTES) if fd == out_fd else (info, MAX_INFO_BYTES)
            buf += chunk
            if len(buf) > cap:
                raise StartupError(f"init printed more than {cap} bytes before it was ready: {_said(out)!r}")
    try:
        return int(json.loads(bytes(info))["child-pid"])
    except (ValueError, KeyError, TypeError) as e:
        raise StartupError(f"bwrap reported no child pid: {bytes(info[:200])!r}") from e


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


def pin(pid: int, parent: int) -> int:
    """A pidfd of `pid`, checked to be a live child of `parent` (bwrap, whose pid cannot be reused while we have not reaped it)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError as e:
        raise StartupError(f"init {pid} exited as soon as it was ready") from e
    try:
        # The pidfd names whatever process had `pid` when it was opened; the parent read after it, with the pidfd still
        # live afterwards, belongs to that same process.
        if _parent(pid) != parent:
            raise StartupError(f"pid {pid} is not bwrap {parent}'s child (the init exited and the pid was reused)")
        signal.pidfd_send_signal(pidfd, 0)
    except (StartupError, ProcessLookupError) as e:
        os.close(pidfd)
        if isinstance(e, StartupError):
            raise
        raise StartupError(f"init {pid} exited as soon as it was ready") from e
    return pidfd
