"""UidPool: one host uid per live sandbox instance, so the kernel's per-uid limits are per sandbox.

Why: inotify instances (fs.inotify.max_user_instances), POSIX message queue bytes (RLIMIT_MSGQUEUE), pipe buffers
(fs.pipe-user-pages-soft) and process counts are charged to the host uid a process runs as; with one uid for every sandbox,
one sandbox exhausting a limit made the call fail in all the others.

Ids: `base` (BackendConfig.sandbox_uid, B) owns the base rootfs and every layer on disk and never runs a process; each live
instance (standbys included) runs as its own uid Y from B+1..B+count-1 and sees its lower layers through idmapped mounts made
with a user namespace mapping B to Y (`userns`), so every sandbox's root owns the shared files, and the files it writes in
its upper are Y's (a snapshot shifts them back to B, backend.py). Y is given back only once its sandbox's cgroup is empty
(the caller releases after teardown), lowest first, so the namespaces made, one per id ever used and kept with their fds
until `close`, stay as few as the most sandboxes ever alive at once.

A pool starts empty, also on a restarted daemon's state dir: recovery (statedir.py) killed the dead daemon's sandboxes first.
Whatever still runs as an id of the range when the pool is made (a process that outlived that kill, or another daemon given
the same range, a misconfiguration) is skipped for the pool's life, so no live sandbox shares a uid with another process.
"""

from __future__ import annotations

import heapq
import logging
import os
import threading
from collections.abc import Iterable

from openk3.sandbox.linux import userns
from openk3.sandbox.protocol import Busy

logger = logging.getLogger(__name__)


def running_uids(lo: int, hi: int, proc: str = "/proc") -> set[int]:
    """Host uids in lo..hi-1 that some process runs as (its real, effective, saved or file-system uid)."""
    found = set()
    for pid in os.listdir(proc):
        if not pid.isdigit():
            continue
        try:
            with open(os.path.join(proc, pid, "status")) as f:
                line = next((x for x in f if x.startswith("Uid:")), "")
        except OSError:
            continue  # exited meanwhile
        found |= {u for u in map(int, line.split()[1:]) if lo <= u < hi}
    return found


class UidPool:
    def __init__(self, base: int, count: int, helper: str, in_use: Iterable[int] = ()) -> None:
        self.base = base
        self.count = count
        self._helper = helper
        self._lock = threading.Lock()
        self._strangers = frozenset(in_use)  # ids some other process ran as when the pool was made: never handed out
        if self._strangers:
            logger.warning("host uids %s already run processes that are no sandbox of this daemon; they are skipped", sorted(self._strangers)[:16])
        self._next = base + 1  # never handed out yet: this id and all above it, strangers apart
        self._freed: list[int] = []  # a heap: lowest first
        self._held: set[int] = set()
        self._userns: dict[int, int] = {}  # id -> fd of its user namespace (B -> id), kept until close

    def take(self) -> tuple[int, int]:
        """A free host uid and the fd of its namespace (the pool's; do not close it); Busy when every id is held."""
        with self._lock:
            if self._freed:
                uid = heapq.heappop(self._freed)
            elif self._fresh() is not None:
                uid = self._next
                self._next += 1
            else:
                raise Busy(
                    f"sandbox_uids={self.count}: all {self.count - 1} host uids ({self.base + 1}..{self.base + self.count - 1}) are "
                    "held by live sandboxes and standbys; destroy some, or start the daemon with a larger --sandbox-uids"
                )
            self._held.add(uid)
            fd = self._userns.get(uid)
        if fd is None:
            try:
                fd = userns.one_id(self._helper, self.base, uid)
            except BaseException:
                self.release(uid)
                raise
            with self._lock:
                self._userns[uid] = fd
        return uid, fd

    def _fresh(self) -> int | None:
        """Move `_next` past strangers; the id it then names, or None when the range is used up."""
        while self._next in self._strangers:
            self._next += 1
        return self._next if self._next < self.base + self.count else None

    def release(self, uid: int) -> None:
        """Give `uid` back; only once no process runs as it (its sandbox's cgroup is empty)."""
        with self._lock:
            self._held.remove(uid)
            heapq.heappush(self._freed, uid)

    def held(self) -> list[int]:
        with self._lock:
            return sorted(self._held)

    def check_integrity(self) -> None:
        """Every id is either held or free, once, and inside the range."""
        with self._lock:
            free = set(self._freed)
            assert len(free) == len(self._freed), "an id was given back twice"
            assert not free & self._held, f"ids both held and free: {sorted(free & self._held)}"
            assert not (free | self._held) & self._strangers, "a stranger's id was handed out"
            assert free | self._held == set(range(self.base + 1, self._next)) - self._strangers, "ids lost or outside the range"

    def close(self) -> None:
        with self._lock:
            fds, self._userns = list(self._userns.values()), {}
        for fd in fds:
            os.close(fd)
