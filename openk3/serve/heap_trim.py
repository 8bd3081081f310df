"""Give the C heap's freed memory back to the kernel when a server goes idle, so that its RSS after any sequence of
requests comes back to within a stated bound of its idle RSS.

Why: a large request (a multi-MB prompt to tokenise, a long prefill) leaves tens to hundreds of MB freed inside glibc's
arenas -- one per thread that allocated -- which glibc keeps for reuse and, under `--cpu-heap keep` (serve/cpu_heap.py), never
trims by itself. Measured with the tiny model (benchmarks/server_memory.py): 3.5 MB prompts left +731 MB RSS with the heap
kept and +404 MB with the C library's defaults, for good. `malloc_trim(0)` returns the free pages of every arena.

When: once no HTTP request is in flight (the engine then has nothing to run either) and the resident size exceeds the
baseline -- the RSS of the started server before its first request (`start`) -- by more than `slack_bytes`. So a busy server keeps its warm heap
(the point of `--cpu-heap keep`), a server left alone comes back down, and a stream of small requests never pays a trim.
The trim runs on a worker thread, never on the event loop. Not glibc: nothing to trim, `trim` reports False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import threading
from collections.abc import Callable

from openk3.serve.cpu_heap import libc_function


def resident_bytes() -> int:
    """This process's resident set size (/proc/self/statm), 0 where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    return libc_function("malloc_trim", [ctypes.c_size_t], ctypes.c_int)


def malloc_trim() -> bool:
    """glibc's malloc_trim(0) over every arena; False where there is none (not glibc)."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)  # its 0 only means that nothing could be released
    return True


class HeapTrimmer:
    """`on_idle()` from the server whenever its last in-flight request ends (any thread; it may trim, so not the loop)."""

    def __init__(self, slack_bytes: int, rss: Callable[[], int] = resident_bytes, trim: Callable[[], bool] = malloc_trim) -> None:
        if slack_bytes < 0:
            raise ValueError(f"HeapTrimmer.slack_bytes={slack_bytes}: expected >= 0")
        self.slack_bytes = slack_bytes
        self._rss, self._trim = rss, trim
        self._lock = threading.Lock()
        self.baseline: int | None = None
        self.trims = 0  # how many times it trimmed (a test and the log read it)

    def start(self) -> None:
        """Take the baseline: the server is built and has served nothing yet."""
        self.baseline = self._rss()

    def on_idle(self) -> bool:
        """Trim when the RSS is more than `slack_bytes` above the baseline; True when it trimmed."""
        if not self._lock.acquire(blocking=False):  # a trim is already running: it covers this idle moment too
            return False
        try:
            if self.baseline is None:
                raise RuntimeError("HeapTrimmer.on_idle before start(): there is no baseline to trim back to")
            if self._rss() <= self.baseline + self.slack_bytes:
                return False
            self.trims += 1
            return self._trim()
        finally:
            self._lock.release()
