"""DiskTier: whole prefixes as files in a private folder, written by a background thread, each verified by a checksum on load.

A file is one tier_record (MAGIC, an 8-byte header length, a JSON header with key, anchor, tail, boundary, payload size and
SHA-256 of the payload, then the payload in transfer.pack layout), the same bytes a prefill engine exports. A load decodes and
so re-hashes the payload: a mismatch (or a wrong key or size) deletes the file and reports a miss, so the caller recomputes.
The budget counts whole records and is kept at `put`, on the caller's thread: the least recently used entries (written or
still queued) go then, and `put` returns their keys, so a caller mirroring this tier on other ranks (a TP rank's shards,
serve/cache/tier_mirror.py) can tell them exactly what left and when. A mirror's own DiskTier has no budget
(`capacity_bytes=None`): it drops what it is told.
Threading: the engine thread calls put/load/drop/deepest; the writer thread writes files; both touch the index under `_lock`.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from openk3.serve.cache import tier_record
from openk3.serve.cache.tier_record import TierRecordError
from openk3.serve.cache.tier_types import AnchorIndex, Counters, TierEntry, TierKind, TierStats

log = logging.getLogger("openk3.serve")


@dataclass(frozen=True)
class _DiskFile:
    anchor: bytes
    tail: tuple[int, ...]
    num_tokens: int
    nbytes: int  # payload plus header, what the budget counts
    path: str


class DiskTier:
    """Files in a private subfolder of `root` (removed by `close`), written by one background thread."""

    def __init__(self, root: str, capacity_bytes: int | None) -> None:
        os.makedirs(root, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="openk3-prefix-", dir=root)
        self.capacity_bytes = capacity_bytes
        self.files: OrderedDict[bytes, _DiskFile] = OrderedDict()  # every entry held, least recently used first: written or queued
        self.pending: dict[bytes, TierEntry] = {}  # the entries of `files` not yet written (served from memory)
        self.index = AnchorIndex()
        self.used_bytes = 0
        self.counters = Counters()
        self._lock = threading.Lock()
        self._queue: queue.Queue[TierEntry | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="openk3-disk-offload", daemon=True)
        self._writer.start()
        # a server killed without close() still removes its files when the interpreter exits
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)

    def path_of(self, key: bytes) -> str:
        return os.path.join(self.dir, key.hex() + ".k3prefix")

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self.files

    def put(self, e: TierEntry) -> list[bytes]:
        """Queue e for writing, most recently used; returns the keys let go to stay within the budget, least recently used
        first (e's own when its record can never fit)."""
        size = tier_record.overhead_bytes(e) + e.nbytes
        gone = []
        with self._lock:
            if e.key in self.files:
                return []
            if self.capacity_bytes is not None and size > self.capacity_bytes:
                return [e.key]
            self.files[e.key] = _DiskFile(e.anchor, e.tail, e.num_tokens, size, self.path_of(e.key))
            self.pending[e.key] = e
            self.index.add(e)
            self.used_bytes += size
            while self.capacity_bytes is not None and self.used_bytes > self.capacity_bytes:
                key, old = self.files.popitem(last=False)
                self._forget(key, old)
                gone.append(key)
        self._queue.put(e)
        return gone

    def drop(self, key: bytes) -> None:
        """Let key's entry go (its file, or its queued write), if held."""
        with self._lock:
            f = self.files.pop(key, None)
            if f is not None:
                self._forget(key, f)

    def _write_loop(self) -> None:
        while True:
            e = self._queue.get()
            try:
                if e is None:
                    return
                self._write(e)
            finally:
                self._queue.task_done()

    def _write(self, e: TierEntry) -> None:
        with self._lock:
            if self.pending.get(e.key) is not e:
                return  # let go before it was written (or put again since: that later put writes it)
        record = tier_record.encode(e)
        path = self.path_of(e.key)
        tmp = path + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(record)
        except OSError as err:  # a full or failing disk: the entry is let go (a later hit recomputes), the writer lives on
            log.warning("disk prefix tier: writing %s failed (%s); the entry is dropped", tmp, err)
            with self._lock:
                self.counters.write_failures += 1
                if self.pending.get(e.key) is e:
                    self._forget(e.key, self.files.pop(e.key))
            if os.path.exists(tmp):
                os.remove(tmp)
            return
        with self._lock:
            if self.pending.get(e.key) is e:
                os.replace(tmp, path)
                del self.pending[e.key]
                self.counters.bytes_in += len(record)
            else:  # let go while it was being written
                os.remove(tmp)

    def _forget(self, key: bytes, f: _DiskFile) -> None:
        """Forget an entry already taken out of `files` (lock held): its queued write is skipped, its file deleted."""
        self.index.remove(f.anchor, f.tail)
        self.used_bytes -= f.nbytes
        if self.pending.pop(key, None) is not None:
            return
        try:
            os.remove(f.path)
        except FileNotFoundError:
            pass

    def deepest(self, salt: bytes, keys: Sequence[bytes], tokens: Sequence[int], page_size: int, limit: int) -> tuple[bytes, int] | None:
        with self._lock:
            return self.index.deepest(salt, keys, tokens, page_size, limit)

    def load(self, key: bytes) -> torch.Tensor | None:
        """The payload for key, or None when it is gone or its checksum does not match (the file is then deleted)."""
        with self._lock:
            f = self.files.get(key)
            if f is None:
                return None
            self.files.move_to_end(key)
            pending = self.pending.get(key)
        if pending is not None:
            self.counters.hits += 1
            self.counters.bytes_out += pending.nbytes
            return pending.buffer
        try:
            with open(f.path, "rb") as fh:
                raw = fh.read()
        except FileNotFoundError:
            raw = b""
        try:
            entry: TierEntry | None = tier_record.decode(raw)
        except TierRecordError:
            entry = None
        if entry is None or entry.key != key:
            self.counters.checksum_failures += 1
            with self._lock:
                if self.files.get(key) is f:
                    del self.files[key]
                    self._forget(key, f)
            return None
        self.counters.hits += 1
        self.counters.bytes_out += len(raw)
        return entry.buffer

    def flush(self) -> None:
        """Wait until every queued write is on disk."""
        self._queue.join()

    def close(self) -> None:
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        self._cleanup()

    def stats(self) -> TierStats:
        c = self.counters
        with self._lock:
            used, n = self.used_bytes, len(self.files)
        return TierStats(
            TierKind.DISK, used, self.capacity_bytes or 0, n, c.bytes_in, c.bytes_out, c.hits, c.checksum_failures, write_failures=c.write_failures
        )
