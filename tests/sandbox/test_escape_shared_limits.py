"""Issue item 2: one sandbox exhausting a per-uid kernel limit (or the host's pty pool) must leave the others able to work.

Each attack runs in sandbox A until the kernel refuses it, with the expected error, so the test knows the limit was reached;
a forked child keeps what A took while sandbox B, alive beside it, asks for the same resource once. The per-uid limits hold
because each live sandbox runs as a host uid of its own (namespace/uids.py): with one uid for all, B's call fails the same
way. ptys are one host-wide pool, which uids do not split; each sandbox's devpts has its own `max=` (linux/ptys.py).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.sandbox

# Run in the sandbox by python3: `take()` claims one unit of the resource or raises OSError.
INOTIFY = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
def take():
    fd = libc.inotify_init()
    if fd < 0:
        raise OSError(ctypes.get_errno(), "inotify_init")
    return fd
"""

# A queue of 10 messages of 8 KiB (the default ceilings of an ipc namespace) charges about 82 KiB of RLIMIT_MSGQUEUE
# (800 KiB per uid by default), so the tenth fails with EMFILE.
MQUEUE = """
import ctypes, itertools, os
libc = ctypes.CDLL(None, use_errno=True)
class Attr(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_long), ("maxmsg", ctypes.c_long), ("msgsize", ctypes.c_long), ("curmsgs", ctypes.c_long), ("pad", ctypes.c_long * 4)]
names = itertools.count()
def take():
    attr = Attr(0, 10, 8192, 0)
    fd = libc.mq_open(f"/q{next(names)}".encode(), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600, ctypes.byref(attr))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "mq_open")
    return fd
"""

# Growing a pipe to 1 MiB (fs.pipe-max-size) takes 256 pages; past fs.pipe-user-pages-soft (16384 pages per uid) an
# unprivileged user's F_SETPIPE_SZ fails with EPERM.
PIPES = """
import fcntl, os
def take():
    r, w = os.pipe()
    try:
        fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 1 << 20)
    except OSError:
        os.close(r)
        os.close(w)
        raise
    return r, w
"""

PTYS = """
import os
def take():
    return os.openpty()
"""

# Takes until refused, prints how many it got and the refusal's errno name, then a forked child holds them all (stdio on
# /dev/null, so the exec returns) until the sandbox is destroyed.
HOG = """
import errno, os, signal
held = []
while True:
    try:
        held.append(take())
    except OSError as e:
        refused = errno.errorcode[e.errno]
        break
print(len(held), refused, flush=True)
if os.fork() == 0:
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    while True:
        signal.pause()
"""

PROBE = """
import errno
try:
    take()
    print("ok")
except OSError as e:
    print(errno.errorcode[e.errno])
"""


def run_python(svc, sid: str, source: str) -> str:
    svc.write_file(sid, "/tmp/attack.py", source.encode())
    r = svc.exec(sid, "python3 /tmp/attack.py", timeout_s=60)
    assert r.exit_code == 0, r
    return r.stdout.decode().strip()


def sysctl(name: str) -> int:
    with open(f"/proc/sys/{name}") as f:
        return int(f.read())


def exhaust(svc, resource: str) -> tuple[str, str, int]:
    """(refusal A met, what B's one try said, how many A took) with A holding all it could."""
    a = svc.create()
    b = svc.create()
    try:
        if svc.backend.uids is not None:
            assert svc.backend.box(a).uid != svc.backend.box(b).uid
        taken, refused = run_python(svc, a, resource + HOG).split()
        return refused, run_python(svc, b, resource + PROBE), int(taken)
    finally:
        svc.destroy(a)
        svc.destroy(b)


@pytest.fixture
def own_uids(svc):
    if svc.backend.uids is None:
        pytest.skip("sandbox_uid=None: every sandbox is host root, so per-uid limits are shared")
    return svc


def test_inotify_instances_of_one_sandbox_leave_others_theirs(own_uids):
    refused, other, taken = exhaust(own_uids, INOTIFY)
    assert refused == "EMFILE" and taken == sysctl("fs/inotify/max_user_instances"), (refused, taken)  # the whole per-uid share
    assert other == "ok"


def test_posix_message_queues_of_one_sandbox_leave_others_theirs(own_uids):
    refused, other, taken = exhaust(own_uids, MQUEUE)
    assert refused == "EMFILE" and taken >= 1, (refused, taken)
    assert other == "ok"


def test_pipe_buffers_of_one_sandbox_leave_others_theirs(own_uids):
    if sysctl("fs/pipe-user-pages-soft") == 0 or sysctl("fs/pipe-max-size") < 2**20:
        pytest.skip("this host sets no per-uid soft limit on pipe buffers, or caps pipes below 1 MiB")
    refused, other, taken = exhaust(own_uids, PIPES)
    assert refused == "EPERM" and taken >= 1, (refused, taken)
    assert other == "ok"


def test_ptys_of_one_sandbox_are_capped_and_leave_others_theirs(either_svc):
    """Both with own uids and as host root: the pty pool is host-wide, and the per-sandbox devpts `max=` is what splits it."""
    refused, other, taken = exhaust(either_svc, PTYS)
    assert other == "ok"
    assert (refused, taken) == ("ENOSPC", either_svc.backend.config.sandbox_ptys)


def test_a_recycled_uid_comes_with_its_whole_share(own_uids):
    """The uid of a destroyed sandbox goes to the next one, whose inotify share is whole again: nothing of the dead sandbox
    outlived its teardown."""
    first = own_uids.create()
    uid = own_uids.backend.box(first).uid
    taken, refused = run_python(own_uids, first, INOTIFY + HOG).split()
    assert refused == "EMFILE"
    own_uids.destroy(first)
    second = own_uids.create()
    try:
        assert own_uids.backend.box(second).uid == uid  # lowest free first
        assert run_python(own_uids, second, INOTIFY + HOG).split() == [taken, "EMFILE"]
    finally:
        own_uids.destroy(second)
