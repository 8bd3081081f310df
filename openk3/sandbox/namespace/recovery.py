"""Who owns a state dir, and what a dead daemon instance left behind (its mounts and cgroups), wherever its state dir is now.

Each daemon instance has a random name `i<10 hex>`. It is written into the mount table (the state tmpfs is mounted with the
source `openk3-sandbox-<name>`), so the name travels with the tmpfs if its directory is renamed, and it names the instance's
cgroup subtree `openk3-sandbox/<name>/` in every hierarchy. While an instance lives it holds an exclusive flock on
`instance.lock` in its state tmpfs; the kernel drops the lock when the process dies, however it dies (kill -9 included). So
an instance is dead when its lock can be taken, or when no state tmpfs carries its name at all.

What a dead instance leaves: the sandboxes' tmpfs and overlay mounts below its state tmpfs, and their cgroups with whatever
still runs there (inits exit when the daemon's pipe closes, but a `setsid` child lives on, and a sandbox frozen mid-snapshot
never sees the pipe close). Those are removed. Its state tmpfs itself, with its layers and snapshot manifests, stays: the
daemon restarted on that dir takes it back (lifecycle.py), and an operator who moved to another dir may still return to it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import uuid

from openk3.sandbox.linux import cgroups, syscalls
from openk3.sandbox.protocol import Conflict

logger = logging.getLogger(__name__)

SOURCE_PREFIX = "openk3-sandbox-"
CGROUP_PARENT = "openk3-sandbox"
LOCK_FILE = "instance.lock"


def new_name() -> str:
    return "i" + uuid.uuid4().hex[:10]


def cgroup_prefix(name: str) -> str:
    return f"{CGROUP_PARENT}/{name}"


def state_mounts(mountinfo: str | None = None) -> dict[str, str]:
    """Mount point -> instance name of every daemon state tmpfs in this mount namespace (octal escapes decoded)."""
    if mountinfo is None:
        with open("/proc/self/mountinfo") as f:
            mountinfo = f.read()
    found = {}
    for line in mountinfo.splitlines():
        left, right = line.split(" - ", 1)
        fstype, source = right.split()[:2]
        if fstype == "tmpfs" and source.startswith(SOURCE_PREFIX):
            found[left.split()[4].encode().decode("unicode_escape")] = source[len(SOURCE_PREFIX) :]
    return found


class InstanceLock:
    """The exclusive flock that says "an instance lives on this state tmpfs"; `take` fails if another process holds it."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    @classmethod
    def take(cls, state: str) -> InstanceLock | None:
        """The lock of the state tmpfs at `state`, or None when a live instance holds it."""
        fd = os.open(os.path.join(state, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return cls(fd)

    @classmethod
    def take_or_refuse(cls, state: str, name: str) -> InstanceLock:
        lock = cls.take(state)
        if lock is None:
            raise Conflict(f"state_dir={state!r}: daemon instance {name} is running on it; stop it or pick another --state-dir")
        return lock

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def unmount_below(point: str) -> list[str]:
    """Detach every mount strictly below `point`, deepest first (a dead instance's sandbox roots); returns them."""
    below = [p for p in syscalls.mounts_under(point) if p != point]
    for p in sorted(below, key=len, reverse=True):
        syscalls.umount(p, detach=True)
    return below


def remove_cgroups(layout: cgroups.Layout, name: str) -> None:
    """Kill what runs in an instance's cgroups (frozen processes too: cgroup.kill, or v1 freeze + SIGKILL + thaw) and rmdir them."""
    cgroups.recover(layout, cgroup_prefix(name))


def clean_dead_instances(layout: cgroups.Layout, keep: str) -> list[str]:
    """Remove the sandbox mounts and cgroups of every dead instance but `keep` (this one); returns the names cleaned."""
    live = {keep}
    cleaned = []
    for point, name in state_mounts().items():
        if name == keep:
            continue
        try:
            lock = InstanceLock.take(point)
        except OSError:
            lock = None  # not ours to judge (unreadable); treat as live
            live.add(name)
            continue
        if lock is None:
            live.add(name)
            continue
        try:
            gone = unmount_below(point)
            remove_cgroups(layout, name)
            logger.warning("removed leftovers of dead sandbox daemon instance %s (state dir now %s): %d mounts", name, point, len(gone))
            cleaned.append(name)
            live.add(name)  # done; its cgroups are gone, the scan below must not count it twice
        finally:
            lock.release()
    control = layout.control_root
    roots = {r for r in (control, *layout.v1_roots.values()) if r}
    orphans = set()
    for root in roots:
        parent = os.path.join(root, CGROUP_PARENT)
        if os.path.isdir(parent):
            orphans |= {d for d in os.listdir(parent) if os.path.isdir(os.path.join(parent, d))} - live
    for name in sorted(orphans):
        # No state tmpfs carries this name any more (unmounted by hand, or a daemon from before instances were named in
        # the mount table): its cgroups can belong to nobody alive.
        remove_cgroups(layout, name)
        logger.warning("removed cgroups of dead sandbox daemon instance %s (its state dir is gone)", name)
        cleaned.append(name)
    return cleaned
