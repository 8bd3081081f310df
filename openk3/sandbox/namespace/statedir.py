"""The daemon's state tmpfs: mounted fresh, or taken back from a predecessor that died on the same dir.

A fresh start mounts a tmpfs named after a new instance (recovery.py) and locks it. A restart on a dir whose tmpfs is still
mounted (the daemon was killed; the mount lives in the host's mount namespace) keeps that tmpfs, its layers and its snapshot
manifests, and keeps its instance name; it first removes what cannot survive the old process: every sandbox mount below it
and every process and cgroup of the old instance (a sandbox frozen by a crash mid-snapshot included: cgroup.kill and the v1
kill path reach frozen tasks). Sandboxes themselves do not survive (their inits exit with the daemon); snapshots do.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

from openk3.sandbox.linux import cgroups, syscalls
from openk3.sandbox.namespace import recovery

MS_REMOUNT = 0x20


@dataclasses.dataclass
class StateDir:
    path: str
    name: str  # the instance name: state tmpfs source and cgroup subtree
    lock: recovery.InstanceLock
    reopened: bool  # a predecessor's tmpfs was taken back (its snapshots are to be reloaded)


def open_state(path: str, layout: cgroups.Layout, store_bytes: int, sandbox_uid: int | None) -> StateDir:
    """The state tmpfs at `path` (a realpath), 0700 root, or 0711 root when sandboxes run as their own uids, which must pass
    on their way to their roots (see docs/sandbox.md, Root)."""
    mode = 0o700 if sandbox_uid is None else 0o711
    flags = syscalls.MS_NOSUID | syscalls.MS_NODEV
    name = recovery.state_mounts().get(path)
    if name is not None:
        lock = recovery.InstanceLock.take_or_refuse(path, name)
        try:
            recovery.unmount_below(path)
            recovery.remove_cgroups(layout, name)
            syscalls.mount("none", path, None, MS_REMOUNT | flags, f"size={store_bytes}")
            os.chown(path, 0, 0)
            os.chmod(path, mode)
            shutil.rmtree(os.path.join(path, "sbx"), ignore_errors=True)
        except BaseException:
            lock.release()
            raise
        return StateDir(path, name, lock, reopened=True)
    # Mounts here that carry no instance name: a daemon from before names were in the mount table, or someone else's.
    for point in sorted(syscalls.mounts_under(path), key=len, reverse=True):
        syscalls.umount(point, detach=True)
    os.makedirs(path, exist_ok=True)
    name = recovery.new_name()
    syscalls.mount(recovery.SOURCE_PREFIX + name, path, "tmpfs", flags, f"size={store_bytes},mode={mode:04o},uid=0,gid=0")
    syscalls.make_private(path)
    return StateDir(path, name, recovery.InstanceLock.take_or_refuse(path, name), reopened=False)
