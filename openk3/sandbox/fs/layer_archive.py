"""Layers as tar.zst: the transport of snapshots between hosts (export, and import into a private staging folder).

Opaque markers travel as pax xattr records, whiteouts as character devices 0:0, files with holes as GNU PAX 1.0 sparse
members (what GNU tar writes and reads with --sparse), so a 20 GiB sparse file travels as its data. An import writes every
member through safetree.Tree: a name that goes through a symlink (one of the archive's own included), an existing name,
or a type a layer cannot hold is refused, so an archive can only ever create entries inside its staging folder.
"""

from __future__ import annotations

import errno
import os
import stat
import tarfile
from typing import BinaryIO

import zstandard

from openk3.sandbox.fs import archive, sparse
from openk3.sandbox.fs.safetree import OVERLAY_XATTRS, Meta, Tree

XATTR_PAX = "SCHILY.xattr."
SPARSE_PREFIX = "GNUSparseFile.0"  # where GNU tar puts a PAX 1.0 sparse member's header name; the real name is a pax record


class _SparseData:
    """A sparse member's body as tarfile reads it: the PAX 1.0 map (decimal lines, padded to a block), then the extents."""

    def __init__(self, fd: int, size: int, spans: list[tuple[int, int]]) -> None:
        # GNU tar ends the map with (size, 0) when the file ends in a hole, so the length survives its extraction too.
        entries = spans + ([(size, 0)] if not spans or spans[-1][0] + spans[-1][1] < size else [])
        text = "".join(f"{n}\n" for pair in entries for n in pair)
        head = f"{len(entries)}\n{text}".encode()
        self.head = head + b"\0" * (-len(head) % tarfile.BLOCKSIZE)
        self.fd = fd
        self.spans = list(spans)
        self.size = len(self.head) + sum(n for _, n in spans)

    def read(self, n: int = -1) -> bytes:
        """Up to `n` bytes, short only at the end (tarfile's copy takes a short read for a truncated file)."""
        n = self.size if n < 0 else n
        parts = []
        if self.head:
            parts.append(self.head[:n])
            self.head = self.head[n:]
            n -= len(parts[-1])
        while n > 0 and self.spans:
            offset, length = self.spans[0]
            data = os.pread(self.fd, min(n, length, sparse.CHUNK), offset) if length else b""
            if length and not data:
                raise ValueError("a layer file shrank while it was exported")  # layers are immutable: this is corruption
            self.spans[0] = (offset + len(data), length - len(data))
            if self.spans[0][1] == 0:
                self.spans.pop(0)
            parts.append(data)
            n -= len(data)
        return b"".join(parts)


def _regular_member(info: tarfile.TarInfo, t: Tree, rel: str, st: os.stat_result) -> tuple[tarfile.TarInfo, int, object]:
    """The member for a regular file: plain, or a PAX 1.0 sparse member when it has holes."""
    fd = t.open_file(rel)
    spans = sparse.extents(fd, st.st_size) if sparse.allocated(st) < st.st_size else [(0, st.st_size)]
    if spans == [(0, st.st_size)] or st.st_size == 0:
        return info, fd, os.fdopen(os.dup(fd), "rb")
    body = _SparseData(fd, st.st_size, spans)
    parent, _, base = rel.rpartition("/")
    info.name = f"{parent}/{SPARSE_PREFIX}/{base}" if parent else f"{SPARSE_PREFIX}/{base}"
    info.size = body.size
    info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": rel, "GNU.sparse.realsize": str(st.st_size)}
    return info, fd, body


def export_tar_zst(root: str, out: BinaryIO) -> None:
    """Write a layer as tar.zst to `out` in chunks; opaque markers travel as pax xattr records, whiteouts as char devices 0:0,
    files with holes as GNU PAX 1.0 sparse members (what GNU tar writes and reads with --sparse)."""
    with zstandard.ZstdCompressor(level=3).stream_writer(out, closefd=False) as z:
        with tarfile.open(fileobj=z, mode="w|", format=tarfile.PAX_FORMAT) as tar, Tree(root) as t:
            for rel, st in t.entries():
                info = tarfile.TarInfo(rel or ".")  # "." carries the layer root's owner and mode
                info.mode, info.uid, info.gid, info.mtime = stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, st.st_mtime
                if stat.S_ISDIR(st.st_mode):
                    info.type = tarfile.DIRTYPE
                    info.pax_headers = {XATTR_PAX + k: v.decode("latin-1") for k, v in t.xattrs(rel).items()}
                elif stat.S_ISREG(st.st_mode):
                    info, fd, body = _regular_member(info, t, rel, st)
                    try:
                        if not info.pax_headers:
                            info.size = st.st_size
                        tar.addfile(info, body)  # type: ignore[arg-type]
                    finally:
                        os.close(fd)
                        if hasattr(body, "close"):
                            body.close()  # type: ignore[attr-defined]
                    continue
                elif stat.S_ISLNK(st.st_mode):
                    info.type, info.linkname = tarfile.SYMTYPE, t.readlink(rel)
                elif stat.S_ISCHR(st.st_mode):
                    info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, os.major(st.st_rdev), os.minor(st.st_rdev)
                elif stat.S_ISFIFO(st.st_mode):
                    info.type = tarfile.FIFOTYPE
                else:
                    continue
                tar.addfile(info)


def _unpack_file(stream: archive.TarStream, info: tarfile.TarInfo, t: Tree, name: str) -> int:
    """Write a regular member's data into a new file (holes of a sparse member stay holes); returns its open descriptor."""
    fd = t.create(name)
    try:
        if info.sparse is None:
            src = stream.extract(info)
            while chunk := src.read(archive.CHUNK):
                os.write(fd, chunk)
        else:
            for offset, chunk in stream.sparse_data(info):
                os.pwrite(fd, chunk, offset)
            os.ftruncate(fd, info.size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _dir_meta(info: tarfile.TarInfo) -> Meta:
    xattrs = tuple(
        (k[len(XATTR_PAX) :], v.encode("latin-1"))
        for k, v in sorted(info.pax_headers.items())
        if k.startswith(XATTR_PAX) and k[len(XATTR_PAX) :] in OVERLAY_XATTRS
    )
    mtime = int(info.mtime * 1e9)
    return Meta(info.uid, info.gid, info.mode & 0o7777, mtime, mtime, xattrs)


def _unpack_entry(stream: archive.TarStream, info: tarfile.TarInfo, t: Tree, name: str) -> None:
    """Create one non-directory member with its metadata."""
    mtime = int(info.mtime * 1e9)
    meta = Meta(info.uid, info.gid, info.mode & 0o7777, mtime, mtime)
    if info.isreg():
        fd = _unpack_file(stream, info, t, name)
        try:
            t.set_meta(name, stat.S_IFREG, meta, fd)
        finally:
            os.close(fd)
        return
    if info.issym():
        t.symlink(name, info.linkname)
        kind = stat.S_IFLNK
    elif info.ischr() and (info.devmajor, info.devminor) == (0, 0):
        kind = stat.S_IFCHR
        t.mknod(name, kind)
    elif info.isfifo():
        kind = stat.S_IFIFO
        t.mknod(name, kind)
    else:
        raise ValueError(f"unsupported type {info.type!r} (a layer holds files, directories, symlinks, FIFOs and whiteouts)")
    t.set_meta(name, kind, meta)


def import_tar_zst(source: archive.Reader, dst: str, budget: archive.Budget) -> None:
    """Unpack a layer streamed from `source` into a fresh private `dst` within `budget`. Names must be plain relative paths;
    no member is ever written through a symlink (not even one of this archive: a component that is a symlink is refused),
    an existing name is never replaced, and devices other than whiteouts, hard links and sockets are refused. A full store
    (ENOSPC) propagates as OSError, for the caller to report as such."""
    stream = archive.TarStream(archive.decompressed(source, budget.limits, budget.what), budget, whiteouts=True, holes_kept=True)
    os.mkdir(dst, 0o700)
    dirs: list[tuple[str, tarfile.TarInfo]] = []
    with Tree(dst) as t:
        for info in stream:
            name = info.name[2:] if info.name.startswith("./") else info.name
            name = name.rstrip("/") if info.isdir() else name
            try:
                if name in (".", ""):
                    if not info.isdir():
                        raise ValueError("the layer root must be a directory")
                    dirs.append(("", info))
                elif info.isdir():
                    t.mkdir(name)
                    dirs.append((name, info))
                else:
                    _unpack_entry(stream, info, t, name)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise
                raise ValueError(f"layer archive entry {info.name!r}: {_why(e)}") from e
            except (ValueError, OverflowError) as e:
                raise ValueError(f"layer archive entry {info.name!r}: {e}") from e
        for name, info in reversed(dirs):
            try:
                t.set_meta(name, stat.S_IFDIR, _dir_meta(info))
            except (OSError, OverflowError) as e:
                raise ValueError(f"layer archive entry {info.name!r}: metadata: {e}") from e


WHY = {
    errno.ELOOP: "its path goes through a symlink (members are never written through links)",
    errno.EEXIST: "a member of that name already exists (duplicate names, or a name replacing a link, are refused)",
    errno.ENOTDIR: "its parent is not a directory",
    errno.ENOENT: "its parent directory is not in the archive before it",
    errno.EXDEV: "its path leaves the layer",
}


def _why(e: OSError) -> str:
    return WHY.get(e.errno or 0, e.strerror or str(e))
