"""inotify through ctypes (the standard library has none): one instance, watches added by open descriptor, events parsed.

Watches are added through `/proc/self/fd/N` of a directory the caller opened (fs/watch.py opens it with openat2 confined
to a sandbox's root), never by a path: the kernel follows that magic link to exactly the opened directory, so a name the
sandbox could swap for a symlink between the check and the watch is never looked up again.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from typing import NamedTuple

from openk3.sandbox.linux.syscalls import LIBC
from openk3.sandbox.protocol import Busy

IN_MODIFY = 0x2
IN_ATTRIB = 0x4
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_UNMOUNT = 0x2000
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x1000000
IN_EXCL_UNLINK = 0x4000000
IN_ISDIR = 0x40000000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC

HEADER = struct.Struct("iIII")  # wd, mask, cookie, len; then `len` bytes of NUL-padded name
READ_BYTES = 1 << 16

LIBC.inotify_init1.argtypes = [ctypes.c_int]
LIBC.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
LIBC.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]


class Event(NamedTuple):
    wd: int  # -1 for IN_Q_OVERFLOW
    mask: int
    cookie: int
    name: bytes  # b"" for events on the watched directory itself


class WatchLimit(Exception):
    """The kernel's per-user watch limit (fs.inotify.max_user_watches) is reached."""


def _errno() -> int:
    return ctypes.get_errno()


class Inotify:
    def __init__(self) -> None:
        fd = LIBC.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            err = _errno()
            if err == errno.EMFILE:
                raise Busy("no inotify instance left for root (sysctl fs.inotify.max_user_instances); stop some watches or raise it")
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self.fd = int(fd)

    def add(self, dirfd: int, mask: int) -> int:
        """Watch the directory open as `dirfd`; returns the watch descriptor."""
        wd = LIBC.inotify_add_watch(self.fd, f"/proc/self/fd/{dirfd}".encode(), mask | IN_ONLYDIR)
        if wd < 0:
            err = _errno()
            if err == errno.ENOSPC:
                raise WatchLimit()
            raise OSError(err, f"inotify_add_watch: {os.strerror(err)}")
        return int(wd)

    def remove(self, wd: int) -> None:
        LIBC.inotify_rm_watch(self.fd, wd)  # EINVAL when it is already gone (its directory deleted): nothing to do

    def read(self) -> list[Event]:
        """Every event queued now ([] when none)."""
        try:
            raw = os.read(self.fd, READ_BYTES)
        except BlockingIOError:
            return []
        events, at = [], 0
        while at + HEADER.size <= len(raw):
            wd, mask, cookie, size = HEADER.unpack_from(raw, at)
            name = raw[at + HEADER.size : at + HEADER.size + size].rstrip(b"\0")
            events.append(Event(wd, mask, cookie, name))
            at += HEADER.size + size
        return events

    def close(self) -> None:
        os.close(self.fd)
