"""Snapshot manifests: whole ones load, torn or forged ones are discarded with their reason (no sandbox needed)."""

from __future__ import annotations

import json
import os

from openk3.sandbox.namespace.manifests import Manifests, Recorded
from openk3.sandbox.namespace.snapshot_settings import SandboxSettings
from openk3.sandbox.protocol import Limits, SnapshotInfo, SnapshotKind

DIGEST = "ab" * 32


def info(snapshot_id: str, layers: tuple[str, ...] = (DIGEST,)) -> SnapshotInfo:
    return SnapshotInfo(snapshot_id=snapshot_id, kind=SnapshotKind.FS, layers=layers, source="sb-1@h", created_at=1.5, captures="files")


def test_round_trip_and_discards(tmp_path):
    m = Manifests(str(tmp_path / "snapshots"))
    m.write(info("snap-a@h"))
    m.write(info("snap-b@h", (DIGEST, "cd" * 32)))
    assert os.stat(m.root).st_mode & 0o777 == 0o700
    assert [n for n in os.listdir(m.root) if n.startswith(".tmp-")] == []  # the temporary name is gone after the rename
    with open(os.path.join(m.root, "snap-a@h.json")) as f:
        whole: dict = json.load(f)["snapshot"]
    forged: dict = {"version": 1, "snapshot": {**whole, "layers": ["../../etc"]}}
    with open(os.path.join(m.root, "snap-c@h.json"), "w") as f:
        json.dump(forged, f)
    with open(os.path.join(m.root, "snap-d@h.json"), "w") as f:  # names another snapshot than its file
        f.write(json.dumps({"version": 1, "snapshot": {**forged["snapshot"], "layers": [DIGEST], "snapshot_id": "snap-x@h"}}))
    good, bad = m.load()
    assert good == [Recorded(info("snap-a@h"), None), Recorded(info("snap-b@h", (DIGEST, "cd" * 32)), None)]
    assert [name for name, _ in bad] == ["snap-c@h.json", "snap-d@h.json"]
    assert "sha256 hex digests" in bad[0][1] and "snap-x@h" in bad[1][1]
    assert sorted(os.listdir(m.root)) == ["snap-a@h.json", "snap-b@h.json"]  # discarded ones are deleted
    m.remove("snap-a@h")
    m.remove("snap-a@h")  # removing twice is harmless (a delete that crashed after the unlink)
    assert [r.info.snapshot_id for r in m.load()[0]] == ["snap-b@h"]


def test_settings_round_trip_and_bad_settings_are_discarded(tmp_path):
    """What a fork of a snapshot runs with survives the daemon (the manifest); settings a create() would refuse are not served."""
    m = Manifests(str(tmp_path / "snapshots"))
    kept = SandboxSettings(Limits(pids=48, cpus=None), {"A": "1"}, "/tmp", 90.0, ("sleep 1",), {"run": "r7"})
    m.write(info("snap-a@h"), kept)
    with open(os.path.join(m.root, "snap-a@h.json")) as f:
        doc = json.load(f)
    doc["snapshot"]["snapshot_id"] = "snap-b@h"
    doc["settings"]["limits"]["pids"] = 1  # below Limits' minimum
    with open(os.path.join(m.root, "snap-b@h.json"), "w") as f:
        json.dump(doc, f)
    good, bad = m.load()
    assert good == [Recorded(info("snap-a@h"), kept)]
    assert [name for name, _ in bad] == ["snap-b@h.json"] and "limits.pids=1" in bad[0][1]
