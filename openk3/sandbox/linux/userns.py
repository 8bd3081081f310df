"""A user namespace that maps one id, made for idmapped mounts (namespace/uids.py) and held as a file descriptor.

The daemon cannot unshare a user namespace itself (the kernel refuses CLONE_NEWUSER to a process with threads) and must not
fork its threaded self, so `openk3-enter userns` (helper_source.py) unshares one, says "ready" and waits on its stdin; the
daemon, root in the parent namespace, writes the maps, opens /proc/<pid>/ns/user and closes the helper's stdin. The helper
is the daemon's unreaped child throughout, so its pid cannot name another process. The namespace lives on through the fd.
"""

from __future__ import annotations

import os
import select
import subprocess
import time

from openk3.sandbox.linux.helper import HOST_ENV
from openk3.sandbox.protocol import SandboxError

READY = b"ready\n"


def _first_line(fd: int, timeout_s: float) -> bytes:
    deadline = time.monotonic() + timeout_s
    out = b""
    while not out.endswith(b"\n") and len(out) < 4096:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        out += chunk
    return out


def one_id(helper: str, inside: int, outside: int, timeout_s: float = 10.0) -> int:
    """An fd of a new user namespace whose only uid and gid are `inside`, which is host id `outside` (no setgroups)."""
    proc = subprocess.Popen([helper, "userns"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=HOST_ENV)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        said = _first_line(proc.stdout.fileno(), timeout_s)
        if said != READY:
            raise SandboxError(f"openk3-enter userns did not become ready within {timeout_s:g} s: {said[:500]!r}")
        for name, text in (("setgroups", "deny"), ("uid_map", f"{inside} {outside} 1\n"), ("gid_map", f"{inside} {outside} 1\n")):
            with open(f"/proc/{proc.pid}/{name}", "w") as f:
                f.write(text)
        return os.open(f"/proc/{proc.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        proc.stdin.close()
        proc.stdout.close()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
