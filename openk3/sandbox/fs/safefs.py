"""Host-side file access confined to a sandbox's root through openat2(RESOLVE_IN_ROOT).

Every path is resolved by the kernel as if the sandbox root were "/": absolute symlinks, `..` and magic links cannot leave it,
so a sandbox symlink to /etc/passwd reads the sandbox's /etc/passwd. Files are opened O_NONBLOCK and must be regular files, so a
FIFO or device planted by the sandbox cannot hang or redirect the daemon.
"""

from __future__ import annotations

import os
import stat

from openk3.sandbox.linux.syscalls import openat2
from openk3.sandbox.protocol import DirEntry, InvalidArgument, NotFound, QuotaExceeded

READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY


def _open(root: str, path: str, flags: int, mode: int = 0) -> int:
    if not path or "\0" in path:
        raise InvalidArgument(f"path={path!r}: expected a non-empty path without NUL bytes")
    rootfd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return openat2(rootfd, path.lstrip("/") or ".", flags, mode)
    except FileNotFoundError as e:
        raise NotFound(f"path={path!r}: no such file in the sandbox") from e
    except OSError as e:
        raise InvalidArgument(f"path={path!r}: {e.strerror}") from e
    finally:
        os.close(rootfd)


def read_file(root: str, path: str, max_bytes: int) -> bytes:
    fd = _open(root, path, READ_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(f"path={path!r}: not a regular file")
        if st.st_size > max_bytes:
            raise InvalidArgument(f"path={path!r}: {st.st_size} bytes exceeds max_bytes={max_bytes}")
        chunks = []
        while data := os.read(fd, 1 << 20):
            chunks.append(data)
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_file(root: str, path: str, data: bytes, mode: int = 0o644, owner: int | None = None) -> None:
    """Create or replace a regular file; `owner` is the host uid of the sandbox's root, so the sandbox can modify it later."""
    fd = _open(root, path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOCTTY, mode)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(f"path={path!r}: not a regular file")
        if owner is not None and (st.st_uid, st.st_gid) != (owner, owner):
            os.fchown(fd, owner, owner)
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except OSError as e:
        if e.errno == 28:
            raise QuotaExceeded(f"path={path!r}: sandbox disk quota exhausted") from e
        raise
    finally:
        os.close(fd)


def list_dir(root: str, path: str) -> list[DirEntry]:
    fd = _open(root, path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        entries = []
        for name in sorted(os.listdir(fd)):
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            kind = "dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else ("symlink" if stat.S_ISLNK(st.st_mode) else "other")
            entries.append(DirEntry(name=name, kind=kind, size=st.st_size, mode=stat.S_IMODE(st.st_mode)))
        return entries
    finally:
        os.close(fd)
