"""Sparse files and the shared layer store (issue 32 items 3 and 7): holes stay holes in snapshots, exports and imports, and
what a snapshot or an import will write is charged against the sandbox's and the caller's quotas and the store's free space
before anything is written."""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
import time

import pytest
import zstandard

from openk3.sandbox.api import transfer
from openk3.sandbox.fs import archive, tree
from openk3.sandbox.protocol import InvalidArgument, Limits, QuotaExceeded
from tests.sandbox.test_archive_limits import export_with_layer

pytestmark = pytest.mark.sandbox

MIB = 2**20
GIB = 2**30
# 20 GiB long, two 1 MiB extents of data (one at the start, one at 10 GiB), holes elsewhere.
SPARSE = (
    "python3 -c \"import os; f = open('/root/huge', 'wb'); f.write(os.urandom(1 << 20)); f.seek(10 << 30); f.write(b'middle' * 174763); f.truncate(20 << 30)\""
)
CHECK = "python3 -c \"f = open('/root/huge', 'rb'); f.seek(10 << 30); print(f.read(12)); import os; print(os.stat('/root/huge').st_size)\""


def store_used(svc) -> int:
    st = os.statvfs(svc.backend.store.root)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_a_20gib_sparse_file_snapshots_as_its_data(svc):
    """The attack: a 16 MiB-disk sandbox, a 20 GiB sparse file, a snapshot. It takes its 2 MiB of data, at once."""
    sid = svc.create(limits=Limits(disk_bytes=16 * MIB))
    snap = None
    try:
        assert svc.exec(sid, SPARSE).exit_code == 0
        before = store_used(svc)
        start = time.monotonic()
        snap = svc.snapshot(sid)
        took = time.monotonic() - start
        grew = store_used(svc) - before
        assert grew < 8 * MIB and took < 10, (grew, took)
        assert 2 * MIB <= snap.stored_bytes < 4 * MIB
        (child,) = svc.fork(snap.snapshot_id, 1)
        try:
            assert svc.exec(child, CHECK).stdout == b"b'middlemiddle'\n21474836480\n"
            assert int(svc.exec(child, "du -k /root/huge | cut -f1").stdout) < 4096  # still sparse inside the fork
        finally:
            svc.destroy(child)
    finally:
        svc.destroy(sid)
        if snap is not None:
            svc.delete_snapshot(snap.snapshot_id)


def test_sparse_layers_export_and_import_as_sparse(svc):
    sid = svc.create(limits=Limits(disk_bytes=16 * MIB))
    try:
        assert svc.exec(sid, SPARSE).exit_code == 0
        snap = svc.snapshot(sid)
    finally:
        svc.destroy(sid)
    archive = svc.export_snapshot(snap.snapshot_id)
    assert len(archive) < 4 * MIB  # the holes were not written out as zeros
    digests = snap.layers
    svc.delete_snapshot(snap.snapshot_id)
    before = store_used(svc)
    imported = svc.import_snapshot(archive)  # 20 GiB apparent: over max_member_bytes, but it carries 2 MiB of data
    try:
        assert imported.layers == digests and store_used(svc) - before < 8 * MIB
        clone = svc.create(imported.snapshot_id)
        try:
            assert svc.exec(clone, CHECK).stdout == b"b'middlemiddle'\n21474836480\n"
        finally:
            svc.destroy(clone)
    finally:
        svc.delete_snapshot(imported.snapshot_id)


def test_per_sandbox_store_quota_is_decided_before_writing(svc):
    sid = svc.create(limits=Limits(store_bytes=5 * MIB))
    first = None
    try:
        svc.exec(sid, "head -c 3145728 /dev/urandom > /root/a")
        first = svc.snapshot(sid)
        svc.exec(sid, "head -c 2097152 /dev/urandom > /root/b")  # the upper now holds 5 MiB: 3 + 5 > 5
        before = store_used(svc)
        with pytest.raises(QuotaExceeded, match="limits.store_bytes=5242880"):
            svc.snapshot(sid)
        assert store_used(svc) - before < MIB and os.listdir(svc.backend.store.tmp) == []
        svc.delete_snapshot(first.snapshot_id)
        first = None
        second = svc.snapshot(sid)  # its own 5 MiB alone fit
        svc.delete_snapshot(second.snapshot_id)
    finally:
        svc.destroy(sid)
        if first is not None:
            svc.delete_snapshot(first.snapshot_id)


def test_a_snapshot_that_cannot_fit_the_store_fails_at_once(svc):
    """Other reservations leave less than the change set: refused before writing, the store unchanged."""
    sid = svc.create()
    try:
        svc.exec(sid, "head -c 4194304 /dev/urandom > /root/a")
        store = svc.backend.store
        with store.reserve(store.free_bytes() - 2 * MIB, "another snapshot in flight"):
            before = store_used(svc)
            with pytest.raises(QuotaExceeded, match="needs .* bytes in the layer store"):
                svc.snapshot(sid)
            assert store_used(svc) - before < MIB and os.listdir(store.tmp) == []
    finally:
        svc.destroy(sid)


def test_the_callers_charge_sees_the_bytes_before_they_are_written(svc):
    seen: list[int] = []

    def quota(total: int) -> None:
        seen.append(total)
        if total > 2 * MIB:
            raise QuotaExceeded(f"caller quota: {total} bytes")

    sid = svc.create()
    try:
        svc.exec(sid, "head -c 3145728 /dev/urandom > /root/a")
        with pytest.raises(QuotaExceeded, match="caller quota"):
            svc.backend.snapshot(sid, charge=quota)
        with pytest.raises(QuotaExceeded, match="caller quota"):
            svc.backend.fork(sid, 2, charge=quota)
        assert svc.backend.snapshots() == [] and svc.backend.sandboxes() == [sid] and seen[-1] >= 3 * MIB
        snap = svc.snapshot(sid)
    finally:
        svc.destroy(sid)
    archive = svc.export_snapshot(snap.snapshot_id)
    svc.delete_snapshot(snap.snapshot_id)
    with pytest.raises(QuotaExceeded, match="caller quota"):
        transfer.import_snapshot(svc.backend, io.BytesIO(archive), svc._archive_limits(None), charge=quota)
    assert svc.backend.store.refcounts() == {} and os.listdir(svc.backend.store.tmp) == []


def gnu_tar_layer(tmp_path, fmt: list[str]) -> bytes:
    """A layer archive made by GNU tar with --sparse in the given format, of a directory holding one sparse file."""
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    with open(src / "big", "wb") as f:
        f.write(b"head")
        f.seek(64 * MIB)
        f.write(b"tail")
    raw = subprocess.run(["tar", "-c", "--sparse", *fmt, "-f", "-", "-C", str(src), "."], capture_output=True, check=True).stdout
    return zstandard.ZstdCompressor().compress(raw)


@pytest.mark.parametrize("fmt", [["--format=gnu"], ["--format=posix", "--sparse-version=0.1"], ["--format=posix", "--sparse-version=1.0"]])
def test_gnu_tar_sparse_members_import_with_their_holes(svc, tmp_path, fmt):
    data = gnu_tar_layer(tmp_path, fmt)
    layer = svc.backend.store.add_archive(io.BytesIO(data), archive.Budget(svc._archive_limits(None), "GNU tar layer"))
    try:
        st = os.lstat(os.path.join(layer.path, "big"))
        assert st.st_size == 64 * MIB + 4 and st.st_blocks * 512 < MIB
        with open(os.path.join(layer.path, "big"), "rb") as f:
            assert f.read(4) == b"head" and (f.seek(64 * MIB), f.read())[1] == b"tail"
        assert layer.digest == tree.tree_digest(layer.path)
    finally:
        svc.backend.store.decref([layer.digest])


def test_a_malformed_sparse_map_is_a_clear_400(svc):
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        root = tarfile.TarInfo(".")
        root.type = tarfile.DIRTYPE
        tar.addfile(root)
        info = tarfile.TarInfo("GNUSparseFile.0/f")
        info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": "f", "GNU.sparse.realsize": "100"}
        body = b"not a map" + b"\0" * 503
        info.size = len(body)
        tar.addfile(info, io.BytesIO(body))
    layer = zstandard.ZstdCompressor().compress(raw.getvalue())
    with pytest.raises(InvalidArgument, match="sparse map"):
        svc.import_snapshot(export_with_layer(svc, layer, "cd" * 32))
    assert os.listdir(svc.backend.store.tmp) == []


def test_uploading_into_a_full_sandbox_is_a_quota_error(svc):
    sid = svc.create(limits=Limits(disk_bytes=4 * MIB))
    try:
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w") as tar:
            info = tarfile.TarInfo("big")
            info.size = 8 * MIB
            tar.addfile(info, io.BytesIO(os.urandom(info.size)))
        with pytest.raises(QuotaExceeded, match="disk is full"):
            svc.upload_tar(sid, raw.getvalue(), "/root")
    finally:
        svc.destroy(sid)
