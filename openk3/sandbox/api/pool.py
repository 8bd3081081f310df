"""A bounded pool of worker threads for blocking backend calls: `workers` run, at most `max_queue` more wait, the rest are
refused at once (503 Busy) rather than queued without end.

The server keeps two: one for calls that finish in milliseconds to seconds (create, snapshot, restore, files, list, ...) and
one for calls whose length the caller decides (exec, shell commands, archives, environment calls). A long exec then holds a
thread of the second pool only, so however many of them run, create and list still find a free worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

from openk3.sandbox.protocol import Busy


class WorkerPool:
    def __init__(self, name: str, workers: int, max_queue: int) -> None:
        self.name = name
        self.workers = workers
        self.max_queue = max_queue
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"sandbox-{name}")
        self._slots = threading.BoundedSemaphore(workers + max_queue)

    def acquire(self) -> None:
        """Take a slot or raise Busy; every acquire is paired with one `release`."""
        if not self._slots.acquire(blocking=False):
            raise Busy(f"server busy: {self.workers} {self.name} workers and {self.max_queue} queued requests in use; retry later")

    def release(self) -> None:
        self._slots.release()

    def submit(self, fn: Callable[[], Any]) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def run(self, fn: Callable[[], Any]) -> Any:
        return await self.submit(fn)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)
