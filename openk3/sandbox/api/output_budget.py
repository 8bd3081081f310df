"""One daemon-wide budget for the output background processes leave for their callers to fetch.

Each background process (background.py) has two streams, stdout and stderr. A stream keeps the bytes it has not dropped,
under absolute offsets: `start` is the offset of its first kept byte (so also how many bytes it dropped), `end` how many bytes
the process wrote. Offsets never shift: a poller that passes back the offset it was given gets what followed it, or learns
how much of that was dropped. All streams together keep at most `limit_bytes`: before a chunk goes in, the streams keeping
the most (the ones flooding) lose their oldest bytes until it fits, so a quiet process's output survives a neighbour's flood.
Without this each of 1,024 handles could keep 64 MiB per stream (6 spawns printing 128 MiB each took a daemon from 269 to
1,130 MiB).

Bytes are kept in blocks of at most BLOCK bytes, so dropping from the head moves at most one block (deleting from the head of
one big bytearray moved the whole buffer every few chunks), and many tiny writes do not cost an object each.

Contract: the budget's one lock guards every stream's blocks and offsets; streams come from `stream()` and go back through
`release()`.
"""

from __future__ import annotations

import collections
import threading

from openk3.sandbox.protocol import InvalidArgument

BLOCK = 1 << 16
MIN_LIMIT_BYTES = 1 << 20
DEFAULT_OUTPUT_BUDGET = 256 << 20  # all handles together; 1,024 handles x 2 streams x 64 MiB would be 128 GiB


class Stream:
    """One output stream's kept bytes: `blocks` hold offsets `start`..`end`."""

    def __init__(self) -> None:
        self.blocks: collections.deque[bytearray] = collections.deque()
        self.start = 0
        self.end = 0

    @property
    def kept(self) -> int:
        return self.end - self.start


class OutputBudget:
    def __init__(self, limit_bytes: int) -> None:
        if limit_bytes < MIN_LIMIT_BYTES:
            raise InvalidArgument(f"output_budget_bytes={limit_bytes}: expected >= {MIN_LIMIT_BYTES} (1 MiB)")
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()
        self._streams: set[Stream] = set()
        self._buffered = 0
        self._dropped = 0

    def stream(self) -> Stream:
        s = Stream()
        with self._lock:
            self._streams.add(s)
        return s

    def release(self, *streams: Stream) -> None:
        """Stop keeping these streams' bytes (their handle is gone)."""
        with self._lock:
            for s in streams:
                if s in self._streams:
                    self._streams.remove(s)
                    self._buffered -= s.kept
                    s.blocks.clear()
                    s.start = s.end

    def append(self, stream: Stream, data: bytes) -> None:
        with self._lock:
            if stream not in self._streams:
                return  # released while its process was still printing: nobody can read it any more
            if len(data) > self.limit_bytes:
                self._drop(stream, stream.kept)
                stream.start += len(data) - self.limit_bytes
                self._dropped += len(data) - self.limit_bytes
                stream.end = stream.start
                data = data[-self.limit_bytes :]
            over = self._buffered + len(data) - self.limit_bytes
            while over > 0:
                victim = max(self._streams, key=lambda s: s.kept)
                n = min(over, victim.kept)
                self._drop(victim, n)
                over -= n
            rest = memoryview(data)
            if stream.blocks and len(stream.blocks[-1]) < BLOCK:
                room = BLOCK - len(stream.blocks[-1])
                stream.blocks[-1].extend(rest[:room])
                rest = rest[room:]
            for i in range(0, len(rest), BLOCK):
                stream.blocks.append(bytearray(rest[i : i + BLOCK]))
            stream.end += len(data)
            self._buffered += len(data)

    def _drop(self, stream: Stream, n: int) -> None:
        """The oldest `n` kept bytes of `stream` go; the lock is held."""
        stream.start += n
        self._buffered -= n
        self._dropped += n
        while n and stream.blocks:
            head = stream.blocks[0]
            if len(head) <= n:
                n -= len(head)
                stream.blocks.popleft()
            else:
                del head[:n]
                n = 0

    def read(self, stream: Stream, offset: int, max_bytes: int) -> tuple[int, bytes]:
        """(bytes dropped between `offset` and the first byte returned, up to `max_bytes` kept bytes from there)."""
        with self._lock:
            skipped = max(0, stream.start - offset)
            pos, parts, want = stream.start, [], max_bytes
            begin = offset + skipped
            for block in stream.blocks:
                if want == 0:
                    break
                if pos + len(block) > begin:
                    part = block[max(0, begin - pos) :][:want]
                    parts.append(bytes(part))
                    want -= len(part)
                pos += len(block)
            return skipped, b"".join(parts)

    def offsets(self, stream: Stream) -> tuple[int, int]:
        """(first kept offset = bytes dropped, end offset = bytes written)."""
        with self._lock:
            return stream.start, stream.end

    @property
    def buffered_bytes(self) -> int:
        with self._lock:
            return self._buffered

    @property
    def dropped_bytes(self) -> int:
        """Bytes dropped since the daemon started (a counter: released streams do not count as dropped)."""
        with self._lock:
            return self._dropped

    def check_integrity(self) -> None:
        with self._lock:
            total = 0
            for s in self._streams:
                held = sum(len(b) for b in s.blocks)
                assert held == s.kept, f"stream keeps {held} bytes, its offsets say {s.kept}"
                assert all(0 < len(b) <= BLOCK for b in s.blocks), "empty or oversized block"
                total += held
            assert total == self._buffered, f"streams keep {total} bytes, the budget counts {self._buffered}"
            assert self._buffered <= self.limit_bytes, f"{self._buffered} bytes buffered over the limit of {self.limit_bytes}"
