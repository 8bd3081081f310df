"""serve/heap_trim.py and api/idle.py: an idle server trims its C heap back when its RSS has grown past the slack, never
while a request is in flight, and the real malloc_trim gives freed memory back."""

from __future__ import annotations

import asyncio
import ctypes
import subprocess
import sys
import threading

import pytest

from openk3.api.idle import IdleCallback
from openk3.serve.heap_trim import HeapTrimmer


def test_trims_only_past_the_slack_above_the_start_up_rss() -> None:
    rss = [1000]
    trims: list[int] = []

    def trim() -> bool:
        trims.append(rss[0])
        return True

    trimmer = HeapTrimmer(slack_bytes=100, rss=lambda: rss[0], trim=trim)
    with pytest.raises(RuntimeError, match="before start"):
        trimmer.on_idle()
    trimmer.start()
    rss[0] = 1100  # within the slack: a small request's leftovers stay (no trim per request)
    assert not trimmer.on_idle() and trims == []
    rss[0] = 1101
    assert trimmer.on_idle() and trims == [1101] and trimmer.trims == 1
    with pytest.raises(ValueError, match="slack_bytes=-1"):
        HeapTrimmer(-1)


def test_a_trim_in_progress_covers_a_second_idle_moment() -> None:
    entered, release = threading.Event(), threading.Event()

    def slow_trim() -> bool:
        entered.set()
        release.wait()
        return True

    trimmer = HeapTrimmer(0, rss=lambda: 10, trim=slow_trim)
    trimmer.baseline = 0
    worker = threading.Thread(target=trimmer.on_idle)
    worker.start()
    entered.wait()
    assert not trimmer.on_idle()  # not a second trim at the same time
    release.set()
    worker.join()
    assert trimmer.trims == 1


FREED_BUT_KEPT = """
import ctypes
from openk3.serve.heap_trim import malloc_trim, resident_bytes
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallopt(-1, 2**30)  # M_TRIM_THRESHOLD: glibc keeps what is freed (what --cpu-heap keep does)
libc.mallopt(-3, 2**25)  # M_MMAP_THRESHOLD: the 16 KiB blocks come from the heap
blocks = [libc.malloc(16 << 10) for _ in range(8192)]  # 128 MiB
for b in blocks:
    ctypes.memset(b, 1, 16 << 10)
for b in blocks:
    libc.free(b)
held = resident_bytes()
assert malloc_trim()
print(held - resident_bytes())
"""


def test_malloc_trim_returns_freed_heap_memory() -> None:
    """In a process of its own: the heap settings it makes are process-wide."""
    if not hasattr(ctypes.CDLL(None), "mallopt"):
        pytest.skip("not glibc")
    out = subprocess.run([sys.executable, "-c", FREED_BUT_KEPT], capture_output=True, text=True, check=True)
    assert int(out.stdout) > 100 << 20


async def _nothing(*args: object) -> None:
    return None


def test_the_callback_runs_once_the_last_request_has_ended() -> None:
    """Two requests overlap: no idle moment until both have ended."""
    idle = threading.Event()
    seen_in_flight: list[int] = []

    async def main() -> None:
        gate = asyncio.Event()

        async def app(scope: dict, receive: object, send: object) -> None:
            if scope.get("path") == "/slow":
                await gate.wait()

        def on_idle() -> None:
            seen_in_flight.append(wrapped.in_flight)
            idle.set()

        wrapped = IdleCallback(app, on_idle)
        slow = asyncio.create_task(wrapped({"type": "http", "path": "/slow"}, _nothing, _nothing))
        await asyncio.sleep(0)
        await wrapped({"type": "http", "path": "/fast"}, _nothing, _nothing)
        assert wrapped.in_flight == 1 and not idle.is_set()  # the slow one is still in flight: no callback was scheduled
        gate.set()
        await slow
        await asyncio.get_running_loop().run_in_executor(None, idle.wait)
        await wrapped({"type": "lifespan"}, _nothing, _nothing)  # not an HTTP request: not counted

    asyncio.run(main())
    assert seen_in_flight == [0]
