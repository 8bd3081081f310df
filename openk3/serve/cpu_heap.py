"""Keep freed heap memory in the process for reuse when serving on CPU (glibc's mallopt), so that each step's large
temporaries do not page-fault afresh on every step.

Why: glibc serves an allocation above its mmap threshold (128 KiB at start, adapting up to 32 MiB) with fresh pages from
the kernel and returns them on free, and it trims the top of the heap back to the kernel as well. A prefill step allocates
tens of MB of short-lived tensors (projections, chunk buffers, conv buffers), so every step touches fresh pages and pays a
page fault per 4 KiB -- on a virtual machine that is most of the cost of a plain copy. Measured on the dev box: the KDA
chunked prefill of a 16 x 128-token packed step takes 18-25 ms with the default settings and 10-11 ms with the heap kept.
This is what the usual advice for CPU inference with torch (preloading tcmalloc or jemalloc) buys, done from inside the
process. It is process-wide and keeps the heap at its high-water mark while requests keep coming; a server that goes idle gives
the excess back (serve/heap_trim.py).

So it is a process option, never a side effect of building an engine: `openk3 serve` and `openk3 generate` apply it unless
`--cpu-heap system` (default from OPENK3_CPU_HEAP, else keep); a program using `LLM` calls keep_heap_for_reuse() itself.
Not glibc (macOS, musl): nothing to do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from typing import Any

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
_KEEP_BELOW = 1 << 30  # allocations below 1 GiB come from the heap, and freed ones stay there for reuse
_KEEP_BELOW_CAPPED = 32 << 20  # the largest threshold every 64-bit glibc accepts


HEAP_MODES = ("keep", "system")


def default_heap_mode() -> str:
    """The CLI's default for --cpu-heap: OPENK3_CPU_HEAP when set, else keep."""
    return os.environ.get("OPENK3_CPU_HEAP", "keep")


@functools.cache
def keep_heap_for_reuse() -> bool:
    """Apply the setting once per process; True when it is in effect."""
    return _mallopt()


def apply_heap_mode(mode: str) -> bool:
    """The --cpu-heap option: "keep" applies the setting, "system" leaves the C library's defaults; True when applied."""
    if mode not in HEAP_MODES:
        raise ValueError(f"--cpu-heap {mode!r} is invalid: expected one of {list(HEAP_MODES)} (OPENK3_CPU_HEAP gives the default)")
    return mode == "keep" and keep_heap_for_reuse()


def libc_function(name: str, argtypes: list, restype: object) -> Any:
    """The C library's `name`, typed for ctypes; None where there is none of that name (not glibc: macOS, musl)."""
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c")), name)
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


def _mallopt() -> bool:
    mallopt = libc_function("mallopt", [ctypes.c_int, ctypes.c_int], ctypes.c_int)
    if mallopt is None:
        return False
    # glibc's mallopt returns 1 on success; some versions cap the mmap threshold at 32 MiB. The trim threshold above the
    # mmap threshold keeps freed memory in the heap (the C int caps it at 2 GiB - 1).
    for keep_below in (_KEEP_BELOW, _KEEP_BELOW_CAPPED):
        if mallopt(_M_MMAP_THRESHOLD, keep_below) == 1:
            return mallopt(_M_TRIM_THRESHOLD, min(2 * keep_below, 2**31 - 1)) == 1
    return False
