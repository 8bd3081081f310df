"""Host-side trees the daemon builds and reads itself, without ever following a symlink: layer staging, snapshot copies,
squash, digests and exports.

Every name in these trees is chosen by a caller (an imported archive's members) or by a sandbox (its upper, copied into a
layer while it is frozen, or not: a freeze can time out). A path joined as a string lets a symlink planted in it send a host
write anywhere: a layer holding `l -> /` and then `l/tmp/x` wrote /tmp/x on the host as root. Here every path is resolved by
the kernel from one directory descriptor with RESOLVE_STRICT (no symlink, magic link, `..` above the root or other mount in
any component), and the last component is created or opened by a *at call that does not follow it either (O_EXCL creates,
O_NOFOLLOW opens, AT_SYMLINK_NOFOLLOW metadata). A component that is a symlink is an error (ELOOP), never a detour.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import stat

from openk3.sandbox.linux.syscalls import RESOLVE_STRICT, openat2

OVERLAY_XATTRS = ("trusted.overlay.opaque",)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


@dataclasses.dataclass(frozen=True)
class Meta:
    """What an entry carries besides its contents: owner, permission bits, times, overlay markers (directories only)."""

    uid: int
    gid: int
    mode: int  # permission bits only (stat.S_IMODE)
    atime_ns: int
    mtime_ns: int
    xattrs: tuple[tuple[str, bytes], ...] = ()

    @classmethod
    def of(cls, st: os.stat_result, xattrs: dict[str, bytes] | None = None) -> Meta:
        return cls(st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode), st.st_atime_ns, st.st_mtime_ns, tuple(sorted((xattrs or {}).items())))


def split(rel: str) -> tuple[str, str]:
    """(parent, name) of a relative path whose every component is a real name: no '', '.', '..', leading or double '/'."""
    parts = rel.split("/")
    if not rel or any(p in ("", ".", "..") for p in parts) or "\0" in rel:
        raise ValueError(f"path {rel!r}: expected a relative path of plain names")
    return "/".join(parts[:-1]), parts[-1]


class Tree:
    """One directory opened once; every entry below it reached by resolution that follows nothing (see the module doc).

    Not thread-safe: one walk or one build at a time. Keeps the descriptor of the last parent directory it used, because a
    build or a walk visits the entries of one directory together.
    """

    def __init__(self, root: str) -> None:
        self.root = root
        self.fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        self._parent: tuple[str, int] | None = None

    def close(self) -> None:
        self._drop_parent()
        os.close(self.fd)

    def __enter__(self) -> Tree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _drop_parent(self) -> None:
        if self._parent is not None:
            os.close(self._parent[1])
            self._parent = None

    def open(self, rel: str, flags: int, mode: int = 0) -> int:
        """A descriptor of `rel` ('' is the root) opened with `flags`, no component followed if it is a symlink."""
        return openat2(self.fd, rel or ".", flags | os.O_NOFOLLOW, mode, RESOLVE_STRICT)

    def parent(self, rel: str) -> tuple[int, str]:
        """(descriptor of rel's directory, rel's last name); the descriptor stays owned by the tree."""
        parent, name = split(rel)
        if self._parent is None or self._parent[0] != parent:
            fd = self.open(parent, os.O_PATH | os.O_DIRECTORY)
            self._drop_parent()
            self._parent = (parent, fd)
        return self._parent[1], name

    # reading

    def lstat(self, rel: str) -> os.stat_result:
        if not rel:
            return os.stat(self.fd)
        dfd, name = self.parent(rel)
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)

    def entries(self) -> list[tuple[str, os.stat_result]]:
        """(relative path, lstat) of every entry, sorted by path, the root itself as ''; only real directories are entered."""
        out = [("", os.stat(self.fd))]
        stack = [""]
        while stack:
            rel = stack.pop()
            fd = self.open(rel, DIR_FLAGS)
            try:
                with os.scandir(fd) as it:
                    for entry in it:
                        path = f"{rel}/{entry.name}" if rel else entry.name
                        st = entry.stat(follow_symlinks=False)
                        out.append((path, st))
                        if stat.S_ISDIR(st.st_mode):
                            stack.append(path)
            finally:
                os.close(fd)
        out.sort(key=lambda t: t[0])
        return out

    def open_file(self, rel: str) -> int:
        """A regular file for reading: O_NONBLOCK so a FIFO swapped in cannot hang the daemon, then checked to be a file."""
        fd = self.open(rel, os.O_RDONLY | os.O_NONBLOCK)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ValueError(f"{rel!r}: expected a regular file")
        os.set_blocking(fd, True)
        return fd

    def readlink(self, rel: str) -> str:
        dfd, name = self.parent(rel)
        return os.readlink(name, dir_fd=dfd)

    def xattrs(self, rel: str) -> dict[str, bytes]:
        """The overlay markers of a directory (other entries carry none that a layer keeps)."""
        fd = self.open(rel, DIR_FLAGS)
        try:
            found = {}
            for name in OVERLAY_XATTRS:
                try:
                    found[name] = os.getxattr(fd, name)
                except OSError:
                    continue
            return found
        finally:
            os.close(fd)

    # writing (entries are new: an existing name is an error, never replaced or followed)

    def mkdir(self, rel: str) -> None:
        dfd, name = self.parent(rel)
        os.mkdir(name, 0o700, dir_fd=dfd)

    def create(self, rel: str) -> int:
        """A new regular file, open for writing (O_EXCL: a symlink or anything else by that name is EEXIST)."""
        dfd, name = self.parent(rel)
        return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)

    def symlink(self, rel: str, target: str) -> None:
        dfd, name = self.parent(rel)
        os.symlink(target, name, dir_fd=dfd)

    def mknod(self, rel: str, mode: int, device: int = 0) -> None:
        """A FIFO, or the character device 0:0 overlayfs reads as a whiteout (the only device a layer may hold)."""
        dfd, name = self.parent(rel)
        os.mknod(name, mode & ~0o7777, device, dir_fd=dfd)

    def remove(self, rel: str) -> None:
        """Remove an entry if present (a directory with everything below it), following nothing."""
        dfd, name = self.parent(rel)
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=dfd)  # with dir_fd it follows no symlink inside what it removes
        else:
            os.unlink(name, dir_fd=dfd)

    def set_meta(self, rel: str, kind: int, meta: Meta, fd: int | None = None) -> None:
        """Owner, then mode (a chown clears set-id bits), overlay markers and times of a new entry of type `kind`
        (stat.S_IFMT); `fd` is a descriptor of it already open (a file just written), else one is opened here."""
        if stat.S_ISLNK(kind):
            dfd, name = self.parent(rel)
            os.chown(name, meta.uid, meta.gid, dir_fd=dfd, follow_symlinks=False)
            os.utime(name, ns=(meta.atime_ns, meta.mtime_ns), dir_fd=dfd, follow_symlinks=False)
            return
        own = fd is None
        if fd is None:
            # FIFOs and whiteouts cannot be opened for I/O without side effects: an O_PATH descriptor, changed through
            # its /proc/self/fd link (which names that inode, not a path anyone could swap).
            fd = self.open(rel, DIR_FLAGS if stat.S_ISDIR(kind) else os.O_PATH)
        try:
            if stat.S_ISDIR(kind) or stat.S_ISREG(kind):
                os.fchown(fd, meta.uid, meta.gid)
                os.fchmod(fd, meta.mode)
                for key, value in meta.xattrs:
                    os.setxattr(fd, key, value)
                os.utime(fd, ns=(meta.atime_ns, meta.mtime_ns))
            else:
                link = f"/proc/self/fd/{fd}"
                os.chown(link, meta.uid, meta.gid)
                os.chmod(link, meta.mode)
                os.utime(link, ns=(meta.atime_ns, meta.mtime_ns))
        finally:
            if own:
                os.close(fd)
