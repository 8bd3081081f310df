"""HandleTable: the daemon's table of one kind of long-lived handle (terminal sessions, directory watches), bounded in number.

Every handle records the sandbox it belongs to, so a destroy or restore of that sandbox can end its handles (and ownership
of a handle follows from its sandbox). At `limit` the oldest handle that has ended is dropped to make room; when none has
ended a new one is refused (503 Busy) rather than the table growing without end.

Contract: the table's lock guards the dict only; handles are made, stopped and joined outside it.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from openk3.sandbox.protocol import Busy, NotFound


class Handle(Protocol):
    sandbox_id: str

    def finished(self) -> bool: ...

    def stop(self, reason: str) -> None:
        """Ask it to end (from any thread); returns at once."""

    def join(self) -> None:
        """Return once it has ended."""


H = TypeVar("H", bound=Handle)


class HandleTable(Generic[H]):
    def __init__(self, field: str, prefix: str, limit: int) -> None:
        self.field = field  # the argument that names a handle, for error messages ("pty_id")
        self.prefix = prefix
        self.limit = limit
        self._lock = threading.Lock()
        self._items: dict[str, H] = {}
        self._pending = 0  # handles being made: counted against the limit before they exist

    def add(self, make: Callable[[str], H]) -> str:
        """Make room, then `make(new_id)` (outside the lock: it may start processes) and register what it returns."""
        with self._lock:
            while len(self._items) + self._pending >= self.limit:
                ended = [k for k, h in self._items.items() if h.finished()]
                if not ended:
                    raise Busy(f"{self.limit} {self.field} handles are active; end some or retry later")
                del self._items[ended[0]]  # dicts keep insertion order: the oldest
            self._pending += 1
        handle_id = f"{self.prefix}{uuid.uuid4().hex[:12]}"
        try:
            handle = make(handle_id)
        finally:
            with self._lock:
                self._pending -= 1
        with self._lock:
            self._items[handle_id] = handle
        return handle_id

    def get(self, handle_id: str) -> H:
        with self._lock:
            if handle_id not in self._items:
                raise NotFound(f"{self.field}={handle_id!r}: no such handle (never made, or its sandbox was destroyed)")
            return self._items[handle_id]

    def end_sandbox(self, sandbox_id: str, reason: str, forget: bool) -> None:
        """End every handle of `sandbox_id` and wait for them; drop them too when `forget` (a destroy)."""
        with self._lock:
            mine = {k: h for k, h in self._items.items() if h.sandbox_id == sandbox_id}
        for h in mine.values():
            h.stop(reason)
        for h in mine.values():
            h.join()
        if forget:
            with self._lock:
                for k in mine:
                    self._items.pop(k, None)

    def ids(self) -> list[str]:
        with self._lock:
            return sorted(self._items)

    def close(self) -> None:
        with self._lock:
            sandboxes = {h.sandbox_id for h in self._items.values()}
        for sid in sandboxes:
            self.end_sandbox(sid, "the daemon is shutting down", forget=True)
