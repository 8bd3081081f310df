"""Files with holes, kept as holes: what a layer stores and charges is what a file has allocated, not its length.

A sandbox with a 16 MiB disk can make a 20 GiB sparse file (tmpfs allocates pages only where data is written); a copy that
writes its length filled the shared 8 GiB layer store for a minute. Data extents come from SEEK_DATA / SEEK_HOLE (tmpfs and
every common host file system answer them), are copied at their offsets, and the length is set with ftruncate, so the copy
allocates what the source did. `allocated` (st_blocks) is the size a snapshot is charged for, decided before it is written.
"""

from __future__ import annotations

import errno
import os

CHUNK = 1 << 20


def allocated(st: os.stat_result) -> int:
    """Bytes the entry occupies on its file system (what a copy made here will occupy too)."""
    return st.st_blocks * 512


def extents(fd: int, size: int) -> list[tuple[int, int]]:
    """(offset, length) of each data extent of the open file `fd` of `size` bytes, in order; [] for a file of holes."""
    found = []
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole from pos to the end
                break
            raise
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        if end > start:
            found.append((start, end - start))
        pos = end
    return found


def copy_extents(src: int, dst: int, size: int, spans: list[tuple[int, int]]) -> None:
    """Write `spans` of `src` at the same offsets of the empty file `dst`, then give it length `size` (the rest stays holes)."""
    for offset, length in spans:
        os.lseek(dst, offset, os.SEEK_SET)
        done = 0
        while done < length:
            sent = os.sendfile(dst, src, offset + done, min(CHUNK, length - done))
            if sent == 0:  # the source shrank under us (a sandbox not frozen): keep what was there
                break
            done += sent
    os.ftruncate(dst, size)


def copy(src: int, dst: int) -> None:
    """Copy the open regular file `src` into the empty `dst`, holes kept."""
    size = os.fstat(src).st_size
    copy_extents(src, dst, size, extents(src, size))
