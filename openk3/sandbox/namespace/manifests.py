"""Snapshot manifests on the state tmpfs: what lets fs snapshots outlive the daemon process.

One small JSON file per snapshot, `snapshots/<snapshot id>.json`, holding its SnapshotInfo (the layer digests, bottom first)
and, for a snapshot of a sandbox, the settings that sandbox had (snapshot_settings.py: what a fork of the snapshot runs with).
A manifest is written to a temporary name, fsynced and renamed into place, then the directory is fsynced: rename is atomic,
so a reader sees either no manifest or a whole one, never a half-written one. A crash between the write and the rename leaves
a `.tmp-*` file, which `load` deletes; a manifest that does not parse (a store that lost writes, a hand edit) is discarded
with its reason, never served.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from typing import NamedTuple

from openk3.sandbox.namespace.snapshot_settings import SandboxSettings
from openk3.sandbox.protocol import InvalidArgument, SnapshotInfo, SnapshotKind, to_jsonable

VERSION = 1
SUFFIX = ".json"
TEMP_PREFIX = ".tmp-"


class Recorded(NamedTuple):
    info: SnapshotInfo
    settings: SandboxSettings | None  # None: imported, or written before settings were kept


class Manifests:
    def __init__(self, root: str) -> None:
        self.root = root
        os.makedirs(root, mode=0o700, exist_ok=True)
        os.chmod(root, 0o700)  # snapshot ids and layer digests are no one else's business

    def _path(self, snapshot_id: str) -> str:
        return os.path.join(self.root, snapshot_id + SUFFIX)

    def _sync_dir(self) -> None:
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def write(self, info: SnapshotInfo, settings: SandboxSettings | None = None) -> None:
        doc = {"version": VERSION, "snapshot": to_jsonable(info)}
        if settings is not None:
            doc["settings"] = settings.to_json()
        body = json.dumps(doc, sort_keys=True).encode()
        temp = os.path.join(self.root, f"{TEMP_PREFIX}{uuid.uuid4().hex}")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.rename(temp, self._path(info.snapshot_id))
        except BaseException:
            try:
                os.unlink(temp)
            except FileNotFoundError:
                pass
            raise
        self._sync_dir()

    def remove(self, snapshot_id: str) -> None:
        try:
            os.unlink(self._path(snapshot_id))
        except FileNotFoundError:
            return
        self._sync_dir()

    def load(self) -> tuple[list[Recorded], list[tuple[str, str]]]:
        """Every whole manifest, and (file name, reason) for each one discarded (and deleted): temporaries and unreadable ones."""
        good: list[Recorded] = []
        bad: list[tuple[str, str]] = []
        for name in sorted(os.listdir(self.root)):
            path = os.path.join(self.root, name)
            if name.startswith(TEMP_PREFIX):
                bad.append((name, "a manifest whose write never finished"))
                os.unlink(path)
                continue
            try:
                recorded = parse(path)
                if name != recorded.info.snapshot_id + SUFFIX:
                    raise ValueError(f"it names snapshot {recorded.info.snapshot_id!r}")
            except (OSError, ValueError, KeyError, TypeError, InvalidArgument) as e:
                bad.append((name, f"unreadable manifest ({type(e).__name__}: {e})"))
                os.unlink(path)
                continue
            good.append(recorded)
        return good, bad


def parse(path: str) -> Recorded:
    with open(path, "rb") as f:
        doc = json.loads(f.read())
    if not isinstance(doc, dict) or doc.get("version") != VERSION or not isinstance(doc.get("snapshot"), dict):
        raise ValueError(f"expected {{'version': {VERSION}, 'snapshot': {{...}}}}")
    s = doc["snapshot"]
    layers = s["layers"]
    # Digests name directories of the store: anything but 64 hex digits (a "/" or "..") is refused, not joined to a path.
    if not isinstance(layers, list) or not all(isinstance(d, str) and re.fullmatch("[0-9a-f]{64}", d) for d in layers):
        raise ValueError("layers: expected a list of sha256 hex digests")
    for key in ("snapshot_id", "source", "captures"):
        if not isinstance(s[key], str):
            raise ValueError(f"{key}: expected a string")
    if not isinstance(s["created_at"], (int, float)):
        raise ValueError("created_at: expected a number")
    stored = s.get("stored_bytes", 0)  # absent from manifests written before store quotas: charged nothing
    if not isinstance(stored, int) or isinstance(stored, bool) or stored < 0:
        raise ValueError("stored_bytes: expected an integer >= 0")
    kind = SnapshotKind(s["kind"])
    if kind is not SnapshotKind.FS:
        raise ValueError(f"kind={kind.value!r}: only fs snapshots persist")
    info = SnapshotInfo(
        snapshot_id=s["snapshot_id"],
        kind=kind,
        layers=tuple(layers),
        source=s["source"],
        created_at=float(s["created_at"]),
        captures=s["captures"],
        stored_bytes=stored,
    )
    return Recorded(info, SandboxSettings.from_json(doc["settings"]) if "settings" in doc else None)
