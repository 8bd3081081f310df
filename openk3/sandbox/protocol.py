"""Types shared by the sandbox backend, the HTTP server and the client.

Every value crossing the API is a frozen dataclass of plain fields, so the server can turn it into JSON with `asdict` and the
client can rebuild it with `from_dict` without a schema library on the client side.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any


class SnapshotKind(str, enum.Enum):
    # "fs": the file tree and its metadata; running processes are not captured, restore restarts the init.
    FS = "fs"
    # "process": the memory of a Python-native environment served by a fork server (see process/forkserver.py).
    PROCESS = "process"


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-sandbox resource limits; None means "no limit beyond the host's"."""

    memory_bytes: int | None = 512 * 2**20
    pids: int | None = 256
    cpus: float | None = 1.0
    disk_bytes: int = 256 * 2**20
    # Files, directories and links the sandbox may create (upper layer and /dev/shm together): tmpfs inodes cost kernel
    # memory that `disk_bytes` does not bound (an empty file uses no blocks).
    inodes: int = 65536

    def __post_init__(self) -> None:
        if self.memory_bytes is not None and self.memory_bytes < 4 * 2**20:
            raise InvalidArgument(f"limits.memory_bytes={self.memory_bytes}: expected None or >= 4 MiB")
        if self.pids is not None and self.pids < 4:
            raise InvalidArgument(f"limits.pids={self.pids}: expected None or >= 4")
        if self.cpus is not None and not 0.01 <= self.cpus <= 1024:
            raise InvalidArgument(f"limits.cpus={self.cpus}: expected None or 0.01..1024")
        if self.disk_bytes < 1 * 2**20:
            raise InvalidArgument(f"limits.disk_bytes={self.disk_bytes}: expected >= 1 MiB")
        if not 64 <= self.inodes <= 2**31:
            raise InvalidArgument(f"limits.inodes={self.inodes}: expected 64..2**31")


@dataclasses.dataclass(frozen=True)
class ArchiveLimits:
    """What one archive transfer (upload_tar, download_tar, import_snapshot) may expand to; None means "the server's".

    `max_bytes` bounds both the uncompressed tar stream and the sum of its members' apparent sizes (a sparse file counts at
    its full length); `max_window_bytes` is the largest zstd window the decompressor accepts. A caller may lower any of them
    per call, never raise one above the server's (`BackendConfig.archive_limits`, documented in docs/sandbox.md).
    """

    max_bytes: int | None = None
    max_members: int | None = None
    max_member_bytes: int | None = None
    max_path_bytes: int | None = None
    max_window_bytes: int | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise InvalidArgument(f"limits.{f.name}={value!r}: expected None or an integer >= 1")

    def within(self, server: ArchiveLimits) -> ArchiveLimits:
        """These limits with the server's filled in; refuses any above the server's."""
        resolved = {}
        for f in dataclasses.fields(self):
            mine, cap = getattr(self, f.name), getattr(server, f.name)
            if mine is not None and cap is not None and mine > cap:
                raise InvalidArgument(f"limits.{f.name}={mine}: expected <= {cap}, the server's limit (callers may only lower it)")
            resolved[f.name] = cap if mine is None else mine
        return ArchiveLimits(**resolved)


@dataclasses.dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool
    oom_killed: bool
    duration_ms: float
    truncated: bool


@dataclasses.dataclass(frozen=True)
class SnapshotInfo:
    snapshot_id: str
    kind: SnapshotKind
    layers: tuple[str, ...]  # content digests, bottom first (fs snapshots)
    source: str  # sandbox or process-environment id it was taken from
    created_at: float
    captures: str  # human-readable statement of what the snapshot holds


@dataclasses.dataclass(frozen=True)
class SandboxStats:
    sandbox_id: str
    memory_bytes: int | None
    pids: int | None
    cpu_usage_s: float | None
    disk_used_bytes: int
    disk_limit_bytes: int
    layer_depth: int
    alive: bool
    expires_at: float


@dataclasses.dataclass(frozen=True)
class DirEntry:
    name: str
    kind: str  # "file" | "dir" | "symlink" | "other"
    size: int
    mode: int


def to_jsonable(value: Any) -> Any:
    """Dataclasses, enums, tuples and bytes into JSON values; bytes travel as latin-1 strings inside {"b": ...}."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, bytes):
        return {"b": value.decode("latin-1")}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: to_jsonable(v) for k, v in value.items()}
    return value


def from_jsonable(cls: type, data: dict[str, Any]) -> Any:
    """Inverse of `to_jsonable` for the flat dataclasses above."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        v = data[f.name]
        if isinstance(v, dict) and set(v) == {"b"}:
            v = v["b"].encode("latin-1")
        elif f.name == "kind" and cls is SnapshotInfo:
            v = SnapshotKind(v)
        elif isinstance(v, list):
            v = tuple(v)
        kwargs[f.name] = v
    return cls(**kwargs)


class SandboxError(Exception):
    """Base of every error the sandbox API raises on purpose; `status` is the HTTP status the server maps it to."""

    status = 500


class InvalidArgument(SandboxError):
    status = 400


class NotFound(SandboxError):
    status = 404


class Conflict(SandboxError):
    status = 409


class QuotaExceeded(SandboxError):
    status = 507


class Busy(SandboxError):
    status = 503


class Unsupported(SandboxError):
    status = 501


ERRORS_BY_NAME: dict[str, type[SandboxError]] = {c.__name__: c for c in (SandboxError, InvalidArgument, NotFound, Conflict, QuotaExceeded, Busy, Unsupported)}


# Archive streams over HTTP (download_tar, export_snapshot): a sequence of frames, each a kind byte, a 4-byte big-endian length
# and the payload: data chunks, then END, or ERROR carrying {"type", "message"} when the stream fails part way (the status
# line was sent long before). A stream that stops without END or ERROR was cut off.
FRAME_DATA, FRAME_ERROR, FRAME_END = b"D", b"E", b"Z"
FRAME_HEADER = 5
MAX_FRAME_BYTES = 1 << 24


def frame(kind: bytes, payload: bytes = b"") -> bytes:
    return kind + len(payload).to_bytes(4, "big") + payload


class FrameParser:
    """Incremental reader of those frames: `feed` returns the data chunks completed so far, raises on an ERROR frame."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self.ended = False

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buf += chunk
        out = []
        while len(self._buf) >= FRAME_HEADER and not self.ended:
            kind, size = bytes(self._buf[:1]), int.from_bytes(self._buf[1:FRAME_HEADER], "big")
            if kind not in (FRAME_DATA, FRAME_ERROR, FRAME_END) or size > MAX_FRAME_BYTES:
                raise SandboxError(f"archive stream: bad frame (kind {kind!r}, {size} bytes)")
            if len(self._buf) < FRAME_HEADER + size:
                break
            payload = bytes(self._buf[FRAME_HEADER : FRAME_HEADER + size])
            del self._buf[: FRAME_HEADER + size]
            if kind == FRAME_DATA:
                out.append(payload)
            elif kind == FRAME_END:
                self.ended = True
            else:
                err = json.loads(payload)
                raise ERRORS_BY_NAME.get(err.get("type", ""), SandboxError)(err.get("message", "archive stream failed"))
        return out

    def close(self) -> None:
        if not self.ended:
            raise SandboxError("archive stream: the connection ended before the archive did")
