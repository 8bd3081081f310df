"""OutputRing: a stream of bytes with absolute offsets that keeps only its last `capacity` bytes, for terminal output.

Why a ring and not back-pressure: a terminal's reader may go away for good (a client that disconnects), and a command must not
block on its terminal because nobody reads it; a reader that falls behind learns how many bytes it missed (`skipped`) and
goes on from the oldest byte kept, as a terminal's scrollback would. Offsets count every byte ever written, so a reader that
reconnects passes its last offset back and gets exactly what came after it.

Contract: one writer (the terminal's thread) appends and finally closes; any number of readers wait on the condition.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from openk3.sandbox.protocol import InvalidArgument


class Slice(NamedTuple):
    data: bytes
    offset: int  # of the byte after `data`
    skipped: int  # bytes after the offset asked for that were no longer kept
    more: bool  # not closed, or bytes remain past `offset`


class OutputRing:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._buf = bytearray()
        self._start = 0  # offset of _buf[0]
        self._closed = False
        self._cond = threading.Condition()

    @property
    def end(self) -> int:
        with self._cond:
            return self._start + len(self._buf)

    def append(self, data: bytes) -> None:
        with self._cond:
            self._buf += data
            excess = len(self._buf) - self.capacity
            if excess > 0:
                del self._buf[:excess]  # O(1) from the front of a bytearray
                self._start += excess
            self._cond.notify_all()

    def close(self) -> None:
        """No byte follows; wakes every reader."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def read(self, offset: int, max_bytes: int, timeout_s: float) -> Slice:
        """Up to `max_bytes` from `offset` (or from the oldest byte kept, if that is later), waiting up to `timeout_s` for
        a byte past `offset` when there is none yet."""
        with self._cond:
            end = self._start + len(self._buf)
            if offset > end:
                raise InvalidArgument(f"offset={offset}: expected 0..{end}, the bytes written so far")
            self._cond.wait_for(lambda: self._closed or self._start + len(self._buf) > offset, timeout_s)
            begin = max(offset, self._start)
            data = bytes(self._buf[begin - self._start : begin - self._start + max_bytes])
            after = begin + len(data)
            return Slice(data, after, begin - offset, not self._closed or after < self._start + len(self._buf))
