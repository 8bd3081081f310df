"""Writing to a non-blocking fd within a deadline: how much of the bytes went in before it passed.

Shared by a background process's stdin pipe (api/background_input.py) and a terminal's master (namespace/terminal.py): a
command that stops reading must make the call return short, never block a daemon worker or grow a buffer of ours."""

from __future__ import annotations

import os
import select
import time

WRITE_CHUNK = 1 << 16


def write_within(fd: int, data: bytes, timeout_s: float) -> int:
    """Write `data` to the non-blocking `fd`, waiting for room until `timeout_s` has passed; returns the bytes written. Other
    errors (EPIPE, EIO: nobody reads any more) are raised as they are, for the caller to name."""
    view = memoryview(data)
    deadline = time.monotonic() + timeout_s
    while view:
        try:
            view = view[os.write(fd, view[:WRITE_CHUNK]) :]
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            select.select([], [fd], [], min(left, 0.05))
    return len(data) - len(view)
