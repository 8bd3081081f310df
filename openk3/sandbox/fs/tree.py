"""File-tree primitives for overlay layers: copy with metadata, content digest, squash (layer_archive.py: tar.zst transport).

A layer is an overlayfs upper directory frozen in time, so besides files, directories and symlinks it holds whiteouts
(character devices 0:0 that delete a lower path) and opaque directories (xattr trusted.overlay.opaque=y that hide every lower
entry below them). Everything here preserves both, and keeps holes as holes (sparse.py). Hard links are copied as separate
files: a layer is a value, not an inode graph. Every path below a tree's root is reached through safetree.Tree, which never
follows a symlink: the names come from sandboxes and callers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import stat
from typing import NamedTuple

from openk3.sandbox.fs import sparse
from openk3.sandbox.fs.safetree import Meta, Tree

OVERFLOW_ID = 65534  # the kernel's overflowuid/gid: how an id without a mapping shows


class IdShift(NamedTuple):
    """Owners rewritten by a copy: id `host` (uid and gid) becomes `stored`, every other id OVERFLOW_ID. A sandbox's upper
    is its own host uid's, a layer the canonical owner's (namespace/uids.py); anything else (the whiteouts overlayfs makes
    as root) has no owner a sandbox could use, so it gets none."""

    host: int
    stored: int

    def __call__(self, id_: int) -> int:
        return self.stored if id_ == self.host else OVERFLOW_ID


def _meta(st: os.stat_result, ids: IdShift | None, xattrs: dict[str, bytes] | None = None) -> Meta:
    meta = Meta.of(st, xattrs)
    return meta if ids is None else dataclasses.replace(meta, uid=ids(meta.uid), gid=ids(meta.gid))


def is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def copy_entry(src: Tree, rel: str, st: os.stat_result, dst: Tree, dst_rel: str, ids: IdShift | None = None) -> None:
    """Copy one non-directory entry (file with its holes, symlink, whiteout, fifo) with its metadata, owners rewritten by
    `ids` if given; sockets are skipped."""
    kind = stat.S_IFMT(st.st_mode)
    if stat.S_ISREG(kind):
        fin = src.open_file(rel)
        try:
            fout = dst.create(dst_rel)
            try:
                sparse.copy(fin, fout)
                dst.set_meta(dst_rel, kind, _meta(st, ids), fout)
            finally:
                os.close(fout)
        finally:
            os.close(fin)
        return
    if stat.S_ISLNK(kind):
        dst.symlink(dst_rel, src.readlink(rel))
    elif is_whiteout(st) or stat.S_ISFIFO(kind):
        dst.mknod(dst_rel, kind, 0)
    else:
        return  # devices other than whiteouts cannot be made by a sandbox without capabilities; sockets do not persist
    dst.set_meta(dst_rel, kind, _meta(st, ids))


def copy_into(source: Tree, target: Tree, ids: IdShift | None = None) -> None:
    """Copy every entry of `source` into the empty tree `target` (its root's metadata too), holes and markers included,
    owners rewritten by `ids` if given."""
    dirs = []
    for rel, st in source.entries():
        if stat.S_ISDIR(st.st_mode):
            if rel:
                target.mkdir(rel)
            dirs.append((rel, st))
        else:
            copy_entry(source, rel, st, target, rel, ids)
    # Directory metadata last, deepest first, so filling a directory does not bump its mtime afterwards.
    for rel, st in reversed(dirs):
        target.set_meta(rel, stat.S_IFDIR, _meta(st, ids, source.xattrs(rel)))


def copy_tree(src: str, dst: str, ids: IdShift | None = None) -> None:
    """Recursive copy of `src` into a not yet existing `dst`, metadata, holes, whiteouts and opaque markers included; owners
    rewritten by `ids` if given."""
    os.mkdir(dst, 0o700)
    with Tree(src) as source, Tree(dst) as target:
        copy_into(source, target, ids)


def walk_entries(root: str) -> list[tuple[str, os.stat_result]]:
    """(relative path, lstat) of every entry below root, sorted by path; the root itself is ''."""
    with Tree(root) as t:
        return t.entries()


DIGEST_FORMAT = b"openk3-layer-2\n"  # 2: file contents hashed by non-zero 64 KiB chunk, so holes cost nothing to hash
DIGEST_CHUNK = 1 << 16


def _file_digest(t: Tree, rel: str, size: int) -> str:
    """The file's length, then each aligned 64 KiB chunk that is not all zeros, with its index. The same for any allocation
    of the same bytes (a hole and written zeros digest alike), and computed from the data extents only, so a 20 GiB sparse
    file costs its data, not 20 GiB of reads."""
    h = hashlib.sha256(b"%d\n" % size)
    fd = t.open_file(rel)
    try:
        done = -1
        for offset, length in sparse.extents(fd, size):
            for i in range(max(offset // DIGEST_CHUNK, done + 1), (offset + length - 1) // DIGEST_CHUNK + 1):
                chunk = os.pread(fd, DIGEST_CHUNK, i * DIGEST_CHUNK)
                if chunk.count(0) != len(chunk):
                    h.update(i.to_bytes(8, "big"))
                    h.update(chunk)
                done = i
    finally:
        os.close(fd)
    return h.hexdigest()


def tree_digest(root: str, with_owner: bool = True) -> str:
    """Content address of a tree: paths, types, permission bits, owners, contents, link targets, whiteouts, opaque markers.

    Timestamps are left out on purpose: two layers with the same bytes and permissions are the same layer.
    """
    h = hashlib.sha256(DIGEST_FORMAT)
    with Tree(root) as t:
        for rel, st in t.entries():
            fmt = stat.S_IFMT(st.st_mode)
            parts = [rel, oct(fmt), oct(stat.S_IMODE(st.st_mode))]
            if with_owner:
                parts += [str(st.st_uid), str(st.st_gid)]
            if stat.S_ISREG(st.st_mode):
                parts.append(_file_digest(t, rel, st.st_size))
            elif stat.S_ISLNK(st.st_mode):
                parts.append(t.readlink(rel))
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                parts.append(str(st.st_rdev))
            if stat.S_ISDIR(st.st_mode):
                parts += [f"{k}={v.hex()}" for k, v in sorted(t.xattrs(rel).items())]
            h.update("\0".join(parts).encode("utf-8", "surrogateescape") + b"\n")
    return h.hexdigest()


def tree_size(root: str) -> tuple[int, int]:
    """(entries, bytes allocated): what the tree occupies in the store, holes not counted."""
    entries = walk_entries(root)
    return len(entries), sum(sparse.allocated(st) for _, st in entries)


def squash(layers_bottom_first: list[str], dst: str) -> None:
    """Merge a stack of layers into one layer at `dst` with the same overlay view.

    Whiteouts and opaque markers stay in the result because they may still hide entries of the base rootfs below the stack.
    """
    os.mkdir(dst, 0o700)
    with Tree(dst) as target:
        for layer in layers_bottom_first:
            with Tree(layer) as source:
                for rel, st in source.entries():
                    if not rel:
                        # The root's owner and mode as the top layer has them (what the stack showed), like any directory.
                        target.set_meta("", stat.S_IFDIR, Meta.of(st, source.xattrs("")))
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        xattrs = source.xattrs(rel)
                        existing = _lstat(target, rel)
                        if existing is not None and (not stat.S_ISDIR(existing.st_mode) or "trusted.overlay.opaque" in xattrs):
                            target.remove(rel)
                            existing = None
                        if existing is None:
                            target.mkdir(rel)
                        target.set_meta(rel, stat.S_IFDIR, Meta.of(st, xattrs))
                    else:
                        target.remove(rel)
                        copy_entry(source, rel, st, target, rel)


def _lstat(t: Tree, rel: str) -> os.stat_result | None:
    try:
        return t.lstat(rel)
    except FileNotFoundError:
        return None
