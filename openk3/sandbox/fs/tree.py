"""File-tree primitives for overlay layers: copy with metadata, content digest, squash, tar.zst transport.

A layer is an overlayfs upper directory frozen in time, so besides files, directories and symlinks it holds whiteouts
(character devices 0:0 that delete a lower path) and opaque directories (xattr trusted.overlay.opaque=y that hide every lower
entry below them). Everything here preserves both. Hard links are copied as separate files: a layer is a value, not an inode graph.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tarfile
from typing import BinaryIO, NamedTuple

import zstandard

from openk3.sandbox.fs import archive

OVERLAY_XATTRS = ("trusted.overlay.opaque",)
XATTR_PAX = "SCHILY.xattr."
OVERFLOW_ID = 65534  # the kernel's overflowuid/gid: how an id without a mapping shows


class IdShift(NamedTuple):
    """Owners rewritten by a copy: id `host` (uid and gid) becomes `stored`, every other id OVERFLOW_ID. A sandbox's upper
    is its own host uid's, a layer the canonical owner's (namespace/uids.py); anything else (the whiteouts overlayfs makes
    as root) has no owner a sandbox could use, so it gets none."""

    host: int
    stored: int

    def __call__(self, id_: int) -> int:
        return self.stored if id_ == self.host else OVERFLOW_ID


def is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _xattrs(path: str) -> dict[str, bytes]:
    found = {}
    for name in OVERLAY_XATTRS:
        try:
            found[name] = os.getxattr(path, name, follow_symlinks=False)
        except OSError:
            continue
    return found


def _copy_meta(src_st: os.stat_result, dst: str, xattrs: dict[str, bytes], ids: IdShift | None = None) -> None:
    if ids is None:
        os.lchown(dst, src_st.st_uid, src_st.st_gid)
    else:
        os.lchown(dst, ids(src_st.st_uid), ids(src_st.st_gid))
    if not stat.S_ISLNK(src_st.st_mode):
        os.chmod(dst, stat.S_IMODE(src_st.st_mode))
    for name, value in xattrs.items():
        os.setxattr(dst, name, value, follow_symlinks=False)
    os.utime(dst, ns=(src_st.st_atime_ns, src_st.st_mtime_ns), follow_symlinks=False)


def copy_entry(src: str, dst: str, st: os.stat_result, ids: IdShift | None = None) -> None:
    """Copy one non-directory entry (file, symlink, whiteout, fifo) with its metadata."""
    if stat.S_ISREG(st.st_mode):
        shutil.copyfile(src, dst, follow_symlinks=False)
    elif stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dst)
    elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) or stat.S_ISFIFO(st.st_mode):
        os.mknod(dst, st.st_mode, st.st_rdev)
    else:
        return
    _copy_meta(st, dst, {} if stat.S_ISLNK(st.st_mode) else _xattrs(src), ids)


def copy_tree(src: str, dst: str, ids: IdShift | None = None) -> None:
    """Recursive copy of `src` into a not yet existing `dst`, metadata, whiteouts and opaque markers included; owners
    rewritten by `ids` if given."""
    os.mkdir(dst)
    dirs = [(src, dst, os.lstat(src))]
    for dirpath, dstpath, _ in dirs:
        with os.scandir(dirpath) as it:
            for entry in it:
                st = entry.stat(follow_symlinks=False)
                target = os.path.join(dstpath, entry.name)
                if stat.S_ISDIR(st.st_mode):
                    os.mkdir(target)
                    dirs.append((entry.path, target, st))
                else:
                    copy_entry(entry.path, target, st, ids)
    # Directory metadata last, deepest first, so filling a directory does not bump its mtime afterwards.
    for dirpath, dstpath, st in reversed(dirs):
        _copy_meta(st, dstpath, _xattrs(dirpath), ids)


def walk_entries(root: str) -> list[tuple[str, os.stat_result]]:
    """(relative path, lstat) of every entry below root, sorted by path; the root itself is ''."""
    out = [("", os.lstat(root))]
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(os.path.join(root, rel) if rel else root) as it:
            for entry in it:
                path = f"{rel}/{entry.name}" if rel else entry.name
                st = entry.stat(follow_symlinks=False)
                out.append((path, st))
                if stat.S_ISDIR(st.st_mode):
                    stack.append(path)
    out.sort(key=lambda t: t[0])
    return out


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def tree_digest(root: str, with_owner: bool = True) -> str:
    """Content address of a tree: paths, types, permission bits, owners, contents, link targets, whiteouts, opaque markers.

    Timestamps are left out on purpose: two layers with the same bytes and permissions are the same layer.
    """
    h = hashlib.sha256()
    for rel, st in walk_entries(root):
        full = os.path.join(root, rel) if rel else root
        fmt = stat.S_IFMT(st.st_mode)
        parts = [rel, oct(fmt), oct(stat.S_IMODE(st.st_mode))]
        if with_owner:
            parts += [str(st.st_uid), str(st.st_gid)]
        if stat.S_ISREG(st.st_mode):
            parts.append(file_digest(full))
        elif stat.S_ISLNK(st.st_mode):
            parts.append(os.readlink(full))
        elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            parts.append(str(st.st_rdev))
        if stat.S_ISDIR(st.st_mode):
            parts += [f"{k}={v.hex()}" for k, v in sorted(_xattrs(full).items())]
        h.update("\0".join(parts).encode("utf-8", "surrogateescape") + b"\n")
    return h.hexdigest()


def tree_size(root: str) -> tuple[int, int]:
    entries = walk_entries(root)
    return len(entries), sum(st.st_size for _, st in entries if stat.S_ISREG(st.st_mode))


def _remove(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def squash(layers_bottom_first: list[str], dst: str) -> None:
    """Merge a stack of layers into one layer at `dst` with the same overlay view.

    Whiteouts and opaque markers stay in the result because they may still hide entries of the base rootfs below the stack.
    """
    os.mkdir(dst)
    for layer in layers_bottom_first:
        for rel, st in walk_entries(layer):
            src = os.path.join(layer, rel) if rel else layer
            target = os.path.join(dst, rel) if rel else dst
            if not rel:
                continue
            if stat.S_ISDIR(st.st_mode):
                existing = os.lstat(target) if os.path.lexists(target) else None
                opaque = "trusted.overlay.opaque" in _xattrs(src)
                if existing is not None and (not stat.S_ISDIR(existing.st_mode) or opaque):
                    _remove(target)
                    existing = None
                if existing is None:
                    os.mkdir(target)
                _copy_meta(st, target, _xattrs(src))
            else:
                _remove(target)
                copy_entry(src, target, st)


def export_tar_zst(root: str, out: BinaryIO) -> None:
    """Write a layer as tar.zst to `out` in chunks; opaque markers travel as pax xattr records, whiteouts as char devices 0:0."""
    with zstandard.ZstdCompressor(level=3).stream_writer(out, closefd=False) as z:
        with tarfile.open(fileobj=z, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for rel, _st in walk_entries(root):
                full = os.path.join(root, rel) if rel else root
                info = tar.gettarinfo(full, arcname=rel or ".")  # "." carries the layer root's owner and mode
                info.uname = info.gname = ""
                if info.isdir():
                    info.pax_headers = {XATTR_PAX + k: v.decode("latin-1") for k, v in _xattrs(full).items()}
                if info.isreg():
                    with open(full, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)


def import_tar_zst(source: archive.Reader, dst: str, budget: archive.Budget) -> None:
    """Unpack a layer streamed from `source` into a fresh `dst` within `budget`, refusing absolute names, `..`, links leaving
    the tree, devices other than whiteouts and writes through symlinks."""
    stream = archive.TarStream(archive.decompressed(source, budget.limits, budget.what), budget, whiteouts=True)
    os.mkdir(dst)
    dirs = []
    for info in stream:
        name = os.path.normpath(info.name)
        if name == "." and info.isdir():
            dirs.append((dst, info))
            continue
        if name.startswith(("/", "..")) or "/../" in f"/{name}/" or name == ".":
            raise ValueError(f"layer archive entry {info.name!r}: expected a relative path inside the layer")
        parent = os.path.dirname(name)
        if parent and not stat.S_ISDIR(os.lstat(os.path.join(dst, parent)).st_mode):
            raise ValueError(f"layer archive entry {info.name!r}: parent is not a directory")
        target = os.path.join(dst, name)
        if info.isdir():
            os.mkdir(target)
            for key, value in info.pax_headers.items():
                if key.startswith(XATTR_PAX) and key[len(XATTR_PAX) :] in OVERLAY_XATTRS:
                    os.setxattr(target, key[len(XATTR_PAX) :], value.encode("latin-1"))
            dirs.append((target, info))
            continue
        if info.isreg():
            with open(target, "xb") as f:
                shutil.copyfileobj(stream.extract(info), f)
        elif info.issym():
            os.symlink(info.linkname, target)
        elif info.ischr() and (info.devmajor, info.devminor) == (0, 0):
            os.mknod(target, stat.S_IFCHR | 0o000, 0)
        elif info.isfifo():
            os.mkfifo(target)
        else:
            raise ValueError(f"layer archive entry {info.name!r}: unsupported type {info.type!r}")
        os.lchown(target, info.uid, info.gid)
        if not info.issym():
            os.chmod(target, info.mode)
        os.utime(target, (info.mtime, info.mtime), follow_symlinks=False)
    for target, info in reversed(dirs):
        os.chown(target, info.uid, info.gid)
        os.chmod(target, info.mode)
        os.utime(target, (info.mtime, info.mtime))
