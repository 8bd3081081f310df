"""Escape suite, snapshot import (issue 32 item 1): a crafted layer archive writes nothing outside the daemon's private staging
folder, whatever its symlinks, and nothing of a layer whose digest does not match ever reaches the store.

Each attack is a layer archive wrapped in a snapshot archive with its manifest (test_archive_limits.export_with_layer); the
host marker paths are fresh per test, so a write through any of them is seen as the file existing afterwards.
"""

from __future__ import annotations

import io
import os
import tarfile
import uuid

import httpx
import pytest
import zstandard

from openk3.sandbox.api.server import create_app
from openk3.sandbox.protocol import InvalidArgument
from tests.sandbox.test_api import running
from tests.sandbox.test_archive_limits import export_with_layer

pytestmark = pytest.mark.sandbox

ANY_DIGEST = "ab" * 32


def layer(members: list[tarfile.TarInfo | tuple[tarfile.TarInfo, bytes]]) -> bytes:
    """A layer archive (tar.zst) of these members, in this order, after the root entry."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        root = tarfile.TarInfo(".")
        root.type, root.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(root)
        for m in members:
            info, data = m if isinstance(m, tuple) else (m, b"")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)
    return zstandard.ZstdCompressor().compress(raw.getvalue())


def entry(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "", mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, linkname, mode
    return info


def symlink(name: str, target: str) -> tarfile.TarInfo:
    return entry(name, tarfile.SYMTYPE, target, 0o777)


def directory(name: str) -> tarfile.TarInfo:
    return entry(name, tarfile.DIRTYPE, mode=0o755)


@pytest.fixture
def host_dir(tmp_path_factory):
    """A fresh host directory an attack aims at (under /tmp, as in the report); it must stay empty."""
    path = tmp_path_factory.mktemp("import-target")
    yield str(path)
    assert os.listdir(path) == [], f"the import wrote on the host: {os.listdir(path)}"


def attacks(target: str) -> dict[str, bytes]:
    """Layer archives that each try to create a file in the host directory `target` (absolute, under /tmp)."""
    rel = target.lstrip("/")
    up = "../" * 12
    name = f"x-{uuid.uuid4().hex[:8]}"
    payload = (entry(f"l/{rel}/{name}", mode=0o4755), b"#!/bin/sh\nid\n")
    return {
        "symlink to / then a file through it": layer([symlink("l", "/"), payload]),
        "relative symlink climbing out": layer([symlink("l", up.rstrip("/")), payload]),
        "symlink to the target itself": layer([symlink("t", target), (entry(f"t/{name}"), b"x")]),
        "symlink chain": layer([symlink("a", "b"), symlink("b", target), (entry(f"a/{name}"), b"x")]),
        "symlink under a real directory": layer([directory("d"), symlink("d/l", "/"), (entry(f"d/l/{rel}/{name}"), b"x")]),
        "directory member through a symlink": layer([symlink("l", "/"), directory(f"l/{rel}/{name}")]),
        "symlink member through a symlink": layer([symlink("l", "/"), symlink(f"l/{rel}/{name}", "/etc/shadow")]),
        "fifo through a symlink": layer([symlink("l", "/"), entry(f"l/{rel}/{name}", tarfile.FIFOTYPE)]),
        "whiteout through a symlink": layer([symlink("l", "/"), entry(f"l/{rel}/{name}", tarfile.CHRTYPE)]),
        "file replacing a symlink of the same name": layer([symlink("f", f"{target}/{name}"), (entry("f"), b"x")]),
        "hard link to a host file": layer([entry("h", tarfile.LNKTYPE, f"{rel}/{name}")]),
    }


def test_import_never_writes_through_symlinks(svc, host_dir):
    for what, data in attacks(host_dir).items():
        with pytest.raises(InvalidArgument):
            svc.import_snapshot(export_with_layer(svc, data, ANY_DIGEST))
        assert os.listdir(host_dir) == [], what
        assert svc.backend.store.refcounts() == {} and os.listdir(svc.backend.store.tmp) == [], what


def test_import_attack_over_http_is_a_400_and_writes_nothing(svc, host_dir):
    data = attacks(host_dir)["symlink to / then a file through it"]
    with running(create_app(svc, workers=2, reap_interval_s=None)) as url:
        r = httpx.post(f"{url}/v1/import_snapshot", content=export_with_layer(svc, data, ANY_DIGEST))
    assert r.status_code == 400 and r.json()["error"]["type"] == "InvalidArgument", r.text
    assert os.listdir(svc.backend.store.tmp) == []


def test_a_layer_that_does_not_match_its_digest_leaves_nothing(svc):
    """Benign contents under a false digest: refused, and neither the store nor its staging folder keeps any of it."""
    data = layer([directory("work"), (entry("work/f"), b"hello")])
    before = set(os.listdir(svc.backend.store.root))
    with pytest.raises(InvalidArgument, match="does not match"):
        svc.import_snapshot(export_with_layer(svc, data, ANY_DIGEST))
    assert set(os.listdir(svc.backend.store.root)) == before and os.listdir(svc.backend.store.tmp) == []


def test_symlinks_inside_a_layer_still_import(svc):
    """The refusal is of writing through a symlink, not of symlinks: a layer may hold links, absolute ones included."""
    sid = svc.create()
    try:
        svc.exec(sid, "mkdir -p /work/d && echo hi > /work/d/f && ln -s /etc/passwd /work/abs && ln -s d/f /work/rel")
        snap = svc.snapshot(sid)
    finally:
        svc.destroy(sid)
    archive = svc.export_snapshot(snap.snapshot_id)
    svc.delete_snapshot(snap.snapshot_id)
    imported = svc.import_snapshot(archive)
    clone = svc.create(imported.snapshot_id)
    try:
        assert svc.exec(clone, "readlink /work/abs; cat /work/rel").stdout == b"/etc/passwd\nhi\n"
    finally:
        svc.destroy(clone)
        svc.delete_snapshot(imported.snapshot_id)
