"""Capping the ptys of one sandbox: the `max=` of the devpts instance bwrap mounts on its /dev/pts.

bwrap (0.8) mounts a new devpts instance without `max=` and has no option for one, so every sandbox could open ptys up to the
host-wide kernel.pty.max (less kernel.pty.reserve). The daemon (host root) sets it once the init is up: it reaches that mount
through /proc/<init>/root, checked with the init's pidfd to be the init's, and reconfigures it with fspick + fsconfig, which
need no setns (the daemon has threads) and touch no mount flag. devpts parses a reconfiguration as a whole remount, so the
options bwrap gave it are read from the init's mountinfo and passed again. The mount is bwrap's, made inside the sandbox's
mount namespace, so it keeps what only mounts of the host's own namespace get: no draw on kernel.pty.reserve.

The init runs before the cap (after a restore it is the sandbox's own /bin/bash); after it, no pty numbered `max` or above
can be allocated, so any such pty still open is one taken before the cap: `cap` reports them, and the caller fails the start.
"""

from __future__ import annotations

import os
import signal

from openk3.sandbox.linux import syscalls

DEVPTS_ROOT_INO = 1
KEPT_OPTIONS = ("uid", "gid", "mode", "ptmxmode")  # devpts' own options; max is set here, newinstance is implied


def _devpts_line(mountinfo: str) -> tuple[int, int, dict[str, str]]:
    """(major, minor, kept options) of the devpts mounted on /dev/pts, from a mountinfo text."""
    for line in mountinfo.splitlines():
        fields = line.split()
        sep = fields.index("-")
        if fields[4] == "/dev/pts" and fields[sep + 1] == "devpts":
            major, minor = fields[2].split(":")
            options = dict(opt.partition("=")[::2] for opt in fields[sep + 3].split(","))
            return int(major), int(minor), {k: options[k] for k in KEPT_OPTIONS if k in options}
    raise FileNotFoundError("no devpts on /dev/pts")


def cap(pid: int, pidfd: int, max_ptys: int) -> list[int]:
    """Set `max=max_ptys` on the devpts of the sandbox whose init is `pid` (pinned by `pidfd`); the numbers of ptys open at
    or above the cap (taken before it), which the caller must not accept. OSError if the init or its /dev/pts is gone."""
    proc = os.open(f"/proc/{pid}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        # /proc/<pid> is the init's (and so are its root and mountinfo below it) if the init is alive once it is open.
        signal.pidfd_send_signal(pidfd, 0)
        with open(os.open("mountinfo", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc)) as f:
            major, minor, options = _devpts_line(f.read())
        root = os.open("root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=proc)
    finally:
        os.close(proc)
    try:
        resolve = syscalls.RESOLVE_IN_ROOT | syscalls.RESOLVE_NO_MAGICLINKS  # whatever it resolves to is checked below
        pts = syscalls.openat2(root, "dev/pts", os.O_RDONLY | os.O_DIRECTORY, resolve=resolve)
    finally:
        os.close(root)
    try:
        st = os.fstat(pts)
        if (st.st_dev, st.st_ino) != (os.makedev(major, minor), DEVPTS_ROOT_INO):
            raise FileNotFoundError(f"/dev/pts of init {pid} is not the devpts its mountinfo names")
        syscalls.reconfigure(pts, {**options, "max": str(max_ptys)})
        return sorted(int(name) for name in os.listdir(pts) if name.isdigit() and int(name) >= max_ptys)
    finally:
        os.close(pts)
