"""Directory watches (`watch_dir` and friends): inotify events of a sandbox's directory tree (fs/watch.py), queued for the
caller to take, by polling (`watch_events`) or as a stream (`watch_stream`, server side).

Each watch has a thread that moves events from its inotify instance into a queue of at most `max_events`; when the queue is
full, further events are dropped and an "overflow" event stands where they were (as inotify's own IN_Q_OVERFLOW, which is
passed on the same way), so a flood costs bounded memory and the caller learns to rescan. One inotify instance per watch,
so one sandbox's flood never overflows another's watch. A watch ends when stopped, when its sandbox is restored or
destroyed, or when the watched directory goes; a destroy drops it. At most `max_watches` per daemon (the oldest ended one
is dropped first, 503 Busy when all are active): each holds an inotify instance of root's (fs.inotify.max_user_instances).
"""

from __future__ import annotations

import collections
import os
import selectors
import threading

from openk3.sandbox.api.handles import HandleTable
from openk3.sandbox.api.terminals import check_wait
from openk3.sandbox.fs.watch import TreeWatch
from openk3.sandbox.namespace.backend import NamespaceBackend
from openk3.sandbox.protocol import InvalidArgument
from openk3.sandbox.protocol_interactive import WatchEvent, WatchEvents

MAX_QUEUE = 1 << 16
MAX_DIRS = 1 << 16
OVERFLOW = WatchEvent("overflow", "", False, 0)


class _Watch:
    def __init__(self, watch_id: str, sandbox_id: str, tree: TreeWatch, max_events: int) -> None:
        self.watch_id = watch_id
        self.sandbox_id = sandbox_id
        self.tree = tree
        self.max_events = max_events
        self._queue: collections.deque[WatchEvent] = collections.deque()
        self._lost = False  # events were dropped after the last queued one: an overflow event is owed
        self._cond = threading.Condition()
        self._active = True
        self._reason: str | None = None
        self._stop_reason: str | None = None
        self._wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._thread = threading.Thread(target=self._run, name=f"sandbox-{watch_id}", daemon=True)
        self._thread.start()

    def finished(self) -> bool:
        with self._cond:
            return not self._active

    def stop(self, reason: str) -> None:
        with self._cond:
            if self._active and self._stop_reason is None:
                self._stop_reason = reason
                os.eventfd_write(self._wake, 1)

    def join(self) -> None:
        self._thread.join()

    def _push(self, events: list[WatchEvent]) -> None:
        with self._cond:
            for event in events:
                if self._lost or len(self._queue) >= self.max_events:
                    self._lost = True
                elif event is not OVERFLOW or not self._queue or self._queue[-1] != OVERFLOW:
                    self._queue.append(event)
            self._cond.notify_all()

    def _run(self) -> None:
        reason = "internal error"
        try:
            with selectors.DefaultSelector() as sel:
                sel.register(self.tree.fileno, selectors.EVENT_READ)
                sel.register(self._wake, selectors.EVENT_READ)
                while True:
                    ready = {key.fd for key, _ in sel.select()}
                    if self._wake in ready:
                        reason = self._stop_reason or "stopped"
                        break
                    self._push(self.tree.events())
                    if self.tree.ended:
                        reason = self.tree.ended
                        break
        except Exception as e:  # a host failure ends the watch with its reason instead of a silent thread death
            reason = f"internal error: {type(e).__name__}: {e}"
        finally:
            self.tree.close()
            with self._cond:
                self._active = False
                self._reason = reason
                os.close(self._wake)
                self._cond.notify_all()

    def take(self, max_events: int, timeout_s: float) -> WatchEvents:
        """Up to `max_events` queued events (waiting up to `timeout_s` for one), each handed out once."""
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self._lost or not self._active, timeout_s)
            events = [self._queue.popleft() for _ in range(min(max_events, len(self._queue)))]
            if self._lost and not self._queue and len(events) < max_events:
                events.append(OVERFLOW)  # the dropped events came after everything that was queued
                self._lost = False
            done = not self._active and not self._queue and not self._lost
            return WatchEvents(events=tuple(events), active=not done, reason=self._reason if done else None)


class Watches:
    def __init__(self, backend: NamespaceBackend, max_watches: int = 64) -> None:
        self.backend = backend
        self.table: HandleTable[_Watch] = HandleTable("watch_id", "wt-", max_watches)

    def watch_dir(self, sandbox_id: str, path: str, recursive: bool = True, max_events: int = 4096, max_dirs: int = 1024) -> str:
        if not 1 <= max_events <= MAX_QUEUE:
            raise InvalidArgument(f"max_events={max_events}: expected 1..{MAX_QUEUE}")
        if not 1 <= max_dirs <= MAX_DIRS:
            raise InvalidArgument(f"max_dirs={max_dirs}: expected 1..{MAX_DIRS}")
        root = self.backend.merged_root(sandbox_id)
        return self.table.add(lambda watch_id: _Watch(watch_id, sandbox_id, TreeWatch(root, path, recursive, max_dirs), max_events))

    def events(self, watch_id: str, timeout_s: float = 0.0, max_events: int = 4096) -> WatchEvents:
        if max_events < 1:
            raise InvalidArgument(f"max_events={max_events}: expected >= 1")
        check_wait(timeout_s)
        return self.table.get(watch_id).take(max_events, timeout_s)

    def stop(self, watch_id: str) -> None:
        """End the watch; events queued before stay readable until its sandbox is destroyed."""
        watch = self.table.get(watch_id)
        watch.stop("stopped by watch_stop")
        watch.join()
