"""Thin ctypes wrappers for the few Linux calls Python lacks: mount, umount2, openat2 and parts of the new mount API.

Mounting through libc instead of spawning mount(8) keeps create/restore at a few milliseconds; openat2 with RESOLVE_IN_ROOT
lets the host read and write a sandbox's tree with the sandbox's own view of symlinks and `..`; open_tree + mount_setattr make
the idmapped lower layers of an overlay (namespace/uids.py), fspick + fsconfig change a mount another namespace holds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
LIBC.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
LIBC.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
LIBC.syscall.restype = ctypes.c_long

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
MNT_DETACH = 0x2

SYS_OPENAT2 = 437  # same number on every architecture that has it (x86_64, aarch64, riscv64)
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10
# Trees the daemon builds or reads on its own side (layers, staging copies): no symlink, magic link, `..` above the start or
# other mount is ever followed, so nothing planted in the tree can point a host-side write or read elsewhere.
RESOLVE_STRICT = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV

# The new mount API: one number on every architecture (x86_64, aarch64, riscv64).
SYS_OPEN_TREE = 428
SYS_FSCONFIG = 431
SYS_FSPICK = 433
SYS_MOUNT_SETATTR = 442
AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
OPEN_TREE_CLONE = 1
MOUNT_ATTR_IDMAP = 0x00100000
FSPICK_CLOEXEC = 0x1
FSPICK_SYMLINK_NOFOLLOW = 0x2
FSPICK_NO_AUTOMOUNT = 0x4
FSPICK_EMPTY_PATH = 0x8
FSCONFIG_SET_STRING = 1
FSCONFIG_CMD_RECONFIGURE = 7


class OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _check(rc: int, what: str) -> None:
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    rc = LIBC.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags, data.encode() if data else None)
    _check(rc, f"mount {fstype or ''} on {target}")


def umount(target: str, detach: bool = False) -> None:
    _check(LIBC.umount2(target.encode(), MNT_DETACH if detach else 0), f"umount {target}")


def idmapped_tree(path: str, userns_fd: int) -> int:
    """A detached copy of the directory tree at `path` (open_tree OPEN_TREE_CLONE) whose owners appear shifted by the id
    maps of the user namespace `userns_fd`; the files on disk keep theirs. Returns an O_PATH-like fd the caller closes."""
    fd = LIBC.syscall(SYS_OPEN_TREE, ctypes.c_int(AT_FDCWD), path.encode(), ctypes.c_uint(OPEN_TREE_CLONE | os.O_CLOEXEC))
    _check(fd, f"open_tree {path}")
    try:
        attr = MountAttr(attr_set=MOUNT_ATTR_IDMAP, userns_fd=userns_fd)
        rc = LIBC.syscall(SYS_MOUNT_SETATTR, ctypes.c_int(fd), b"", ctypes.c_uint(AT_EMPTY_PATH), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
        _check(rc, f"mount_setattr MOUNT_ATTR_IDMAP on {path}")
    except BaseException:
        os.close(fd)
        raise
    return int(fd)


def reconfigure(fd: int, options: dict[str, str]) -> None:
    """Change the options of the file system whose mount root `fd` is (fspick + fsconfig), wherever that mount lives.

    Legacy file systems (devpts among them) parse the new options as a whole remount: options left out fall back to their
    defaults, so pass every one that is to stay.
    """
    pick = LIBC.syscall(SYS_FSPICK, ctypes.c_int(fd), b"", ctypes.c_uint(FSPICK_CLOEXEC | FSPICK_EMPTY_PATH | FSPICK_NO_AUTOMOUNT | FSPICK_SYMLINK_NOFOLLOW))
    _check(pick, "fspick")
    try:
        for key, value in options.items():
            _check(
                LIBC.syscall(SYS_FSCONFIG, ctypes.c_int(pick), ctypes.c_uint(FSCONFIG_SET_STRING), key.encode(), value.encode(), ctypes.c_int(0)),
                f"fsconfig {key}={value}",
            )
        _check(LIBC.syscall(SYS_FSCONFIG, ctypes.c_int(pick), ctypes.c_uint(FSCONFIG_CMD_RECONFIGURE), None, None, ctypes.c_int(0)), "fsconfig reconfigure")
    finally:
        os.close(int(pick))


def mount_overlay(target: str, lower_top_first: list[str], upper: str, work: str, idmap: int | None = None) -> None:
    """overlayfs at `target`, naming every directory by /proc/self/fd/N of an O_PATH fd opened here; with `idmap` (a user
    namespace fd) every lower directory is an idmapped detached mount instead (see idmapped_tree), the upper stays as it is.

    The kernel keeps the option string as given and shows it in /proc/<pid>/mountinfo, also inside the sandbox: fd names keep
    the daemon's state and cache paths out of it (and keep the string short, so more layers fit its 4 KiB).
    """
    fds = []
    try:
        for path in lower_top_first:
            fds.append(os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) if idmap is None else idmapped_tree(path, idmap))
        for path in (upper, work):
            fds.append(os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
        names = [f"/proc/self/fd/{fd}" for fd in fds]
        lower = ":".join(names[:-2])
        opts = f"lowerdir={lower},upperdir={names[-2]},workdir={names[-1]},redirect_dir=off,metacopy=off,index=off"
        mount("overlay", target, "overlay", MS_NOSUID | MS_NODEV, opts)
    finally:
        for fd in fds:
            os.close(fd)


def make_private(target: str) -> None:
    # The state root must not propagate our per-sandbox mounts into other mount namespaces (or theirs into ours).
    mount("none", target, None, MS_PRIVATE)


def openat2(dirfd: int, path: str | bytes, flags: int, mode: int = 0, resolve: int = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS) -> int:
    # fsencode: a name a sandbox wrote need not be UTF-8 (bytes, or str with surrogate escapes as os.scandir gives it)
    how = OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    fd = LIBC.syscall(SYS_OPENAT2, ctypes.c_int(dirfd), os.fsencode(path), ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    _check(fd, f"openat2 {path!r}")
    return int(fd)


def mounts_under(prefix: str) -> list[str]:
    """Mount points at or below `prefix` in this process's mount namespace (octal escapes decoded)."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if point == prefix or point.startswith(prefix.rstrip("/") + "/"):
                found.append(point)
    return found
