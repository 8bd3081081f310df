"""Types of the interactive half of the API (terminal sessions, directory watches), beside protocol.py's and built the same
way: frozen dataclasses of plain fields that `protocol.to_jsonable` sends and `from_jsonable` (or `watch_events_from`, for the
one nested type) rebuilds."""

from __future__ import annotations

import dataclasses
from typing import Any

from openk3.sandbox.protocol import from_jsonable


@dataclasses.dataclass(frozen=True)
class PtyOutput:
    """Terminal output from the offset asked for (`pty_read`, and each item of `pty_stream`)."""

    data: bytes
    offset: int  # of the byte after `data`: pass it back for what follows
    skipped: int  # bytes after the offset asked for that the buffer no longer held (it keeps the last max_buffer_bytes)
    more: bool  # output may follow: the session runs, or bytes past `offset` are waiting; False means this is the end


@dataclasses.dataclass(frozen=True)
class PtyStatus:
    pty_id: str
    sandbox_id: str
    running: bool
    exit_code: int | None  # None while running; 128+N when killed by signal N
    timed_out: bool
    killed: bool  # ended by pty_kill, or by a destroy or restore of its sandbox
    rows: int
    cols: int
    output_bytes: int  # written by the terminal so far (offsets run up to this)
    error: str | None  # why it could not run or finish, else None


@dataclasses.dataclass(frozen=True)
class WatchEvent:
    """One change in a watched directory tree, as inotify reported it.

    kind: "create", "modify", "attrib", "delete", "moved_from", "moved_to" (a rename inside the tree is a pair with the same
    `cookie`); "delete_self" or "move_self" when the watched directory itself went (the watch ends); "overflow" where events
    were lost (the daemon's queue of `max_events`, or the kernel's, was full: rescan what matters); "watch_limit" for the
    first directory left unwatched because the watch reached `max_dirs`.
    """

    kind: str
    path: str  # absolute, as the sandbox names it ("" for overflow); bytes that are not UTF-8 appear as \\xNN
    is_dir: bool
    cookie: int  # pairs moved_from with moved_to; 0 otherwise


@dataclasses.dataclass(frozen=True)
class WatchEvents:
    """Events taken from a watch's queue (each is returned once), and whether the watch still runs."""

    events: tuple[WatchEvent, ...]
    active: bool  # False once the watch has ended: no event follows these
    reason: str | None  # why it ended (stopped, its sandbox destroyed or restored, the directory gone), else None


def watch_events_from(data: dict[str, Any]) -> WatchEvents:
    return WatchEvents(events=tuple(from_jsonable(WatchEvent, e) for e in data["events"]), active=data["active"], reason=data["reason"])
