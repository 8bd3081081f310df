"""Types shared by the sandbox backend, the HTTP server and the client.

Every value crossing the API is a frozen dataclass of plain fields, so the server can turn it into JSON with `asdict` and the
client can rebuild it with `from_dict` without a schema library on the client side.
"""

from __future__ import annotations

import base64
import binascii
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
    # Bytes this sandbox's live snapshots may hold in the host's shared layer store (their new layers, holes not counted),
    # checked before a snapshot writes anything; None leaves only the store's size (and the caller's quota) as the bound.
    store_bytes: int | None = 2**30

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
        if self.store_bytes is not None and self.store_bytes < 0:
            raise InvalidArgument(f"limits.store_bytes={self.store_bytes}: expected None or >= 0")


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
    stored_bytes: int = 0  # bytes its new layers added to the host's layer store (0 when every layer was there already)


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
class SandboxInfo:
    """One entry of `list_sandboxes`: what a caller gave at create (labels, image) and when the sandbox expires."""

    sandbox_id: str
    labels: dict[str, str]
    image: str | None  # the snapshot it was created over; None for the base rootfs
    created_at: float
    expires_at: float


@dataclasses.dataclass(frozen=True)
class ProcessStatus:
    """A background process (`spawn`): running, or how it ended; byte counts say how much output there is to fetch."""

    process_id: str
    sandbox_id: str
    running: bool
    exit_code: int | None  # None while running
    timed_out: bool
    killed: bool  # ended by process_kill, a destroy or a restore of its sandbox
    oom_killed: bool
    stdout_bytes: int
    stderr_bytes: int
    truncated: bool  # output beyond max_output_bytes was dropped
    error: str | None  # why it could not run or finish (its sandbox went away, its init failed), else None
    # Bytes dropped from the start of each stream to keep the daemon within its output budget: output is available from
    # these offsets on (offsets stay absolute: *_bytes counts everything the process wrote).
    stdout_dropped: int
    stderr_dropped: int


@dataclasses.dataclass(frozen=True)
class ProcessOutput:
    """Output of a background process from the offsets asked for; pass `*_offset` back to get what came after. `*_dropped`:
    bytes between the offset asked for and the first byte returned that the daemon dropped (its output budget); 0 when
    nothing was lost."""

    stdout: bytes
    stderr: bytes
    stdout_offset: int
    stderr_offset: int
    running: bool
    stdout_dropped: int
    stderr_dropped: int


@dataclasses.dataclass(frozen=True)
class OutputChunk:
    """Part of a command's output as `exec_stream` yields it, in the order the daemon read it."""

    stream: str  # "stdout" | "stderr"
    data: bytes


@dataclasses.dataclass(frozen=True)
class DirEntry:
    name: str
    kind: str  # "file" | "dir" | "symlink" | "other"
    size: int
    mode: int


def to_jsonable(value: Any) -> Any:
    """Dataclasses, enums, tuples and bytes into JSON values; bytes travel as base64 inside {"b64": ...} (4/3 of their size,
    where latin-1 text in JSON cost up to 6 bytes per byte); whole files and archives travel as raw bodies instead."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, bytes):
        return {"b64": base64.b64encode(value).decode("ascii")}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, dict):
        encoded = {k: to_jsonable(v) for k, v in value.items()}
        # a caller's dict that looks like a tag ({"b64": ...} or {"dict": ...}) is wrapped, so it comes back a dict
        return {"dict": encoded} if set(value) in TAGS else encoded
    return value


TAGS = ({"b64"}, {"dict"})  # the only single-key objects with a meaning on the wire


def decode_tagged(value: Any) -> Any:
    """Inverse of to_jsonable's tags, through lists and dicts: {"b64": ...} is bytes, {"dict": {...}} a dict taken as it
    is (its values still decoded); every other object is a dict."""
    if isinstance(value, dict):
        if set(value) == {"b64"}:
            return decode_bytes(value)
        if set(value) == {"dict"}:
            inner = value["dict"]
            if not isinstance(inner, dict):
                raise InvalidArgument(f"expected {{'dict': <object>}}, got {{'dict': {type(inner).__name__}}}")
            return {k: decode_tagged(v) for k, v in inner.items()}
        return {k: decode_tagged(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_tagged(v) for v in value]
    return value


def from_jsonable(cls: type, data: dict[str, Any]) -> Any:
    """Inverse of `to_jsonable` for the flat dataclasses above. A field with a default may be absent (a daemon from before the
    field existed sends none): it takes the default; a field without one must be there."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in data and (f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING):
            continue
        v = data[f.name]
        if isinstance(v, dict):
            v = decode_tagged(v)
        elif f.name == "kind" and cls is SnapshotInfo:
            v = SnapshotKind(v)
        elif isinstance(v, list):
            v = tuple(v)
        kwargs[f.name] = v
    return cls(**kwargs)


MAX_LABELS = 64
LABEL_KEY_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-/")


def check_labels(labels: dict[str, str], field: str = "labels") -> dict[str, str]:
    """Labels are for finding sandboxes again (`list_sandboxes(labels=...)`): short keys of [A-Za-z0-9._/-], short values."""
    if len(labels) > MAX_LABELS:
        raise InvalidArgument(f"{field}: {len(labels)} labels; expected at most {MAX_LABELS}")
    for k, v in labels.items():
        if not isinstance(k, str) or not 1 <= len(k) <= 63 or not set(k) <= LABEL_KEY_CHARS:
            raise InvalidArgument(f"{field}: key {k!r}: expected 1-63 characters of A-Z a-z 0-9 . _ - /")
        if not isinstance(v, str) or len(v) > 256 or "\0" in v:
            raise InvalidArgument(f"{field}[{k!r}]={v!r}: expected a string of at most 256 characters without NUL")
    return dict(labels)


def decode_bytes(value: dict[str, Any]) -> bytes:
    """{"b64": ...} back to bytes; anything but strict base64 is an InvalidArgument."""
    try:
        return base64.b64decode(value["b64"], validate=True)
    except (binascii.Error, TypeError, ValueError) as e:
        raise InvalidArgument(f"bytes: expected {{'b64': <base64 string>}} ({e})") from e


class SandboxError(Exception):
    """Base of every error the sandbox API raises on purpose; `status` is the HTTP status the server maps it to."""

    status = 500


class InvalidArgument(SandboxError):
    status = 400


class Unauthorized(SandboxError):
    status = 401


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


ERRORS_BY_NAME: dict[str, type[SandboxError]] = {
    c.__name__: c for c in (SandboxError, InvalidArgument, Unauthorized, NotFound, Conflict, QuotaExceeded, Busy, Unsupported)
}


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
