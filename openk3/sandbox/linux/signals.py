"""Signals for a command running in a sandbox, delivered so that they can reach its processes and nothing else.

A command started through openk3-enter is the helper's only child, the leader of a session and process group of its own
(the helper calls setsid for it). The daemon knows the helper (its own child, pinned by a pidfd opened before anything can
reap it) and finds the command as the helper's child, then proves the find: it opens a pidfd of that pid, reads the
process's parent, group and session, and only then checks that both the helper and the command are still alive, so
neither pid can have been reused in between. The signal goes through that pidfd with PIDFD_SIGNAL_PROCESS_GROUP (Linux
6.9): the kernel signals the group whose id is the command's own struct pid, not a number, so a process that ends and whose
pid is taken by a host process cannot redirect it. Only sandbox processes can be in that group (a process may join a group
only of its own session, and the session is the command's). On an older kernel the command's process alone is signalled.
"""

from __future__ import annotations

import errno
import os
import signal

from openk3.sandbox.protocol import InvalidArgument

PIDFD_SIGNAL_PROCESS_GROUP = 1 << 2
# Standard signals and the real-time range; 32 and 33 are reserved by the C library for its own threads.
NUMBERS = frozenset(range(1, 32)) | frozenset(range(34, 65))


def parse(value: int | str) -> int:
    """A signal number from a number or a name ("SIGINT", "INT", "int")."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidArgument(f"signal={value!r}: expected a number or a name such as 'SIGTERM'")
    if isinstance(value, int):
        if value not in NUMBERS:
            raise InvalidArgument(f"signal={value}: expected 1..31 or 34..64")
        return value
    name = value.upper()
    name = name if name.startswith("SIG") else f"SIG{name}"
    if name not in signal.Signals.__members__:
        raise InvalidArgument(f"signal={value!r}: expected a signal name such as SIGINT, SIGTERM, SIGKILL, SIGHUP, SIGUSR1")
    return int(signal.Signals[name])


def _stat(pid: int) -> tuple[int, int, int]:
    """(parent, process group, session) of `pid` as the host's /proc shows them."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[2]), int(fields[3])


def _alive(pidfd: int) -> bool:
    try:
        signal.pidfd_send_signal(pidfd, 0)
        return True
    except ProcessLookupError:
        return False


def command_pidfd(helper_pidfd: int, helper_pid: int) -> int | None:
    """A pidfd of the command the helper started, once it leads its own session; None while there is none (the helper is
    still entering, or everything has exited). The caller closes it."""
    try:
        with open(f"/proc/{helper_pid}/task/{helper_pid}/children") as f:
            children = f.read().split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    if len(children) != 1:
        return None
    pid = int(children[0])
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    try:
        parent, group, session = _stat(pid)
        # Alive now, so the stat above and the children list were theirs: neither pid was reused in between.
        if _alive(pidfd) and _alive(helper_pidfd) and parent == helper_pid and group == pid and session == pid:
            return pidfd
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        pass
    os.close(pidfd)
    return None


def send_to_group(pidfd: int, number: int) -> None:
    """Signal the process group the pidfd's process leads (ProcessLookupError when the group is empty)."""
    try:
        signal.pidfd_send_signal(pidfd, number, None, PIDFD_SIGNAL_PROCESS_GROUP)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        signal.pidfd_send_signal(pidfd, number)  # Linux < 6.9 has no group flag: the command's process only
