"""Host-DRAM and disk tiers below the device pool: whole prefixes (KDA snapshot + MLA latents in one buffer) keyed like the
device index, each tier with a byte budget and LRU order.

Flow: the device index offloads a snapshot it evicts (`TierStack.offload`) into the host tier, or straight to disk when there is
no host budget; the host tier's LRU overflow goes to disk. Lookups (`find`) return the deepest boundary any tier holds; `load`
returns its buffer. The host tier keeps what it hands back (inclusive), so a prefix that bounces between device and host is
copied down once. Disk writes run on a background thread; an entry waiting to be written is served from memory. A disk load
re-hashes the payload and compares it with the checksum in the file header: a mismatch deletes the file and reports a miss, so
the request recomputes (never wrong text).
Threading: the engine thread calls everything; the writer thread touches only the disk tier, under its lock.
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
import queue
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

MAGIC = b"OPENK3PREFIX1\n"


class TierKind(str, enum.Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


@dataclass(frozen=True)
class TierEntry:
    key: bytes  # snapshot key (hashing.snapshot_key)
    anchor: bytes  # key of the last full page before the boundary (the salt when there is none)
    tail: tuple[int, ...]  # tokens after the anchor
    num_tokens: int  # the boundary p
    buffer: torch.Tensor  # transfer.pack layout, uint8 on the host

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


@dataclass(frozen=True)
class TierStats:
    tier: TierKind
    used_bytes: int
    capacity_bytes: int
    entries: int
    bytes_in: int  # stored into this tier
    bytes_out: int  # loaded from this tier back to the device
    hits: int
    checksum_failures: int = 0


@dataclass
class _Counters:
    bytes_in: int = 0
    bytes_out: int = 0
    hits: int = 0
    checksum_failures: int = 0


@dataclass
class _AnchorIndex:
    """Boundaries by anchor, so a lookup walks the request's page keys once instead of hashing every prefix length."""

    by_anchor: dict[bytes, dict[tuple[int, ...], tuple[bytes, int]]] = field(default_factory=dict)

    def add(self, e: TierEntry) -> None:
        self.by_anchor.setdefault(e.anchor, {})[e.tail] = (e.key, e.num_tokens)

    def remove(self, anchor: bytes, tail: tuple[int, ...]) -> None:
        tails = self.by_anchor.get(anchor)
        if tails is not None:
            tails.pop(tail, None)
            if not tails:
                del self.by_anchor[anchor]

    def deepest(self, salt: bytes, keys: Sequence[bytes], tokens: Sequence[int], page_size: int, limit: int) -> tuple[bytes, int] | None:
        best: tuple[bytes, int] | None = None
        for j, anchor in enumerate((salt, *keys)):
            for tail, (key, p) in self.by_anchor.get(anchor, {}).items():
                start = j * page_size
                if p <= limit and (best is None or p > best[1]) and tuple(tokens[start : start + len(tail)]) == tail:
                    best = (key, p)
        return best


class HostTier:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[bytes, TierEntry] = OrderedDict()
        self.index = _AnchorIndex()
        self.used_bytes = 0
        self.counters = _Counters()

    def __contains__(self, key: bytes) -> bool:
        return key in self.entries

    def put(self, e: TierEntry) -> list[TierEntry]:
        """Store e (most recent); returns what LRU pushed out to make room (e itself when it can never fit)."""
        if e.key in self.entries:
            self.entries.move_to_end(e.key)
            return []
        if e.nbytes > self.capacity_bytes:
            return [e]
        self.entries[e.key] = e
        self.index.add(e)
        self.used_bytes += e.nbytes
        self.counters.bytes_in += e.nbytes
        out = []
        while self.used_bytes > self.capacity_bytes:
            _, old = self.entries.popitem(last=False)
            self.index.remove(old.anchor, old.tail)
            self.used_bytes -= old.nbytes
            out.append(old)
        return out

    def get(self, key: bytes) -> TierEntry:
        e = self.entries[key]
        self.entries.move_to_end(key)
        self.counters.hits += 1
        self.counters.bytes_out += e.nbytes
        return e

    def stats(self) -> TierStats:
        c = self.counters
        return TierStats(TierKind.HOST, self.used_bytes, self.capacity_bytes, len(self.entries), c.bytes_in, c.bytes_out, c.hits)


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
        self.index = _AnchorIndex()
        self.used_bytes = 0
        self.counters = _Counters()
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
        payload = e.buffer.numpy().tobytes()
        header = json.dumps(
            {
                "key": e.key.hex(),
                "anchor": e.anchor.hex(),
                "tail": list(e.tail),
                "num_tokens": e.num_tokens,
                "nbytes": len(payload),
                "sha256": hashlib.sha256(payload).hexdigest(),
            }
        ).encode()
        path = self.path_of(e.key)
        size = len(MAGIC) + 8 + len(header) + len(payload)
        with self._lock:
            fits = size <= self.capacity_bytes
            if not fits:
                self.pending.pop(e.key, None)
                self.index.remove(e.anchor, e.tail)
        if not fits:
            return
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(MAGIC + len(header).to_bytes(8, "little") + header + payload)
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
        payload = self._verified_payload(raw, key)
        if payload is None:
            self.counters.checksum_failures += 1
            with self._lock:
                if self.files.pop(key, None) is not None:
                    self._drop(key, f)
            return None
        self.counters.hits += 1
        self.counters.bytes_out += len(raw)
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)

    @staticmethod
    def _verified_payload(raw: bytes, key: bytes) -> bytes | None:
        if not raw.startswith(MAGIC) or len(raw) < len(MAGIC) + 8:
            return None
        start = len(MAGIC) + 8
        hlen = int.from_bytes(raw[len(MAGIC) : start], "little")
        try:
            header = json.loads(raw[start : start + hlen])
        except (ValueError, UnicodeDecodeError):
            return None
        payload = raw[start + hlen :]
        if header.get("key") != key.hex() or header.get("nbytes") != len(payload):
            return None
        if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            return None
        return payload

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


class TierStack:
    """Host then disk; either may be absent."""

    def __init__(self, host: HostTier | None, disk: DiskTier | None) -> None:
        self.host = host
        self.disk = disk

    def offload(self, e: TierEntry) -> None:
        overflow = self.host.put(e) if self.host is not None else [e]
        if self.disk is not None:
            for old in overflow:
                self.disk.put(old)

    def contains(self, key: bytes) -> bool:
        return (self.host is not None and key in self.host) or (self.disk is not None and key in self.disk)

    def deepest(self, salt: bytes, keys: Sequence[bytes], tokens: Sequence[int], page_size: int, limit: int) -> tuple[TierKind, bytes, int] | None:
        best: tuple[TierKind, bytes, int] | None = None
        if self.host is not None:
            found = self.host.index.deepest(salt, keys, tokens, page_size, limit)
            if found is not None:
                best = (TierKind.HOST, *found)
        if self.disk is not None:
            found = self.disk.deepest(salt, keys, tokens, page_size, limit)
            if found is not None and (best is None or found[1] > best[2]):
                best = (TierKind.DISK, *found)
        return best

    def load(self, tier: TierKind, key: bytes) -> torch.Tensor | None:
        if tier == TierKind.HOST and self.host is not None and key in self.host:
            return self.host.get(key).buffer
        if tier == TierKind.DISK and self.disk is not None:
            return self.disk.load(key)
        return None

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> tuple[TierStats, ...]:
        return tuple(t.stats() for t in (self.host, self.disk) if t is not None)
