"""DiskTier: whole prefixes as files in a private folder, written by a background thread, each verified by a checksum on load.

A file is one tier_record (MAGIC, an 8-byte header length, a JSON header with key, anchor, tail, boundary, payload size and
SHA-256 of the payload, then the payload in transfer.pack layout), the same bytes a prefill engine exports. A load decodes and
so re-hashes the payload: a mismatch (or a wrong key or size) deletes the file and reports a miss, so the caller recomputes.
The budget counts whole files; LRU files are deleted when it is exceeded.
Threading: the engine thread calls put/load/deepest; the writer thread writes files; both touch the index under `_lock`.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class _DiskFile:
    anchor: bytes
    tail: tuple[int, ...]
    num_tokens: int
    nbytes: int  # payload plus header, what the budget counts
    path: str


class DiskTier:
    """Files in a private subfolder of `root` (removed by `close`), written by one background thread."""

    def __init__(self, root: str, capacity_bytes: int) -> None:
        os.makedirs(root, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="openk3-prefix-", dir=root)
        self.capacity_bytes = capacity_bytes
        self.files: OrderedDict[bytes, _DiskFile] = OrderedDict()
        self.pending: dict[bytes, TierEntry] = {}
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
            return key in self.files or key in self.pending

    def put(self, e: TierEntry) -> None:
        with self._lock:
            if e.key in self.files or e.key in self.pending:
                return
            self.pending[e.key] = e
            self.index.add(e)
        self._queue.put(e)

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
        record = tier_record.encode(e)
        path = self.path_of(e.key)
        size = len(record)
        with self._lock:
            fits = size <= self.capacity_bytes
            if not fits:
                self.pending.pop(e.key, None)
                self.index.remove(e.anchor, e.tail)
        if not fits:
            return
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(record)
        os.replace(tmp, path)
        with self._lock:
            self.pending.pop(e.key, None)
            self.files[e.key] = _DiskFile(e.anchor, e.tail, e.num_tokens, size, path)
            self.used_bytes += size
            self.counters.bytes_in += size
            while self.used_bytes > self.capacity_bytes:
                key, old = self.files.popitem(last=False)
                self._drop(key, old)

    def _drop(self, key: bytes, f: _DiskFile) -> None:
        """Forget a file (lock held) and delete it."""
        self.index.remove(f.anchor, f.tail)
        self.used_bytes -= f.nbytes
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
            pending = self.pending.get(key)
            f = self.files.get(key)
            if f is not None:
                self.files.move_to_end(key)
        if pending is not None:
            self.counters.hits += 1
            self.counters.bytes_out += pending.nbytes
            return pending.buffer
        if f is None:
            return None
        try:
            with open(f.path, "rb") as fh:
                raw = fh.read()
        except FileNotFoundError:
            return None
        try:
            entry = tier_record.decode(raw)
        except TierRecordError:
            entry = None
        if entry is None or entry.key != key:
            self.counters.checksum_failures += 1
            with self._lock:
                if self.files.pop(key, None) is not None:
                    self._drop(key, f)
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
            used, n = self.used_bytes, len(self.files) + len(self.pending)
        return TierStats(TierKind.DISK, used, self.capacity_bytes, n, c.bytes_in, c.bytes_out, c.hits, c.checksum_failures)
