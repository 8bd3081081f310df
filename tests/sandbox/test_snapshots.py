"""Spec test plan 10: fs snapshot semantics, forks, restore twice, squash and tar.zst round trips."""

from __future__ import annotations

import io
import os
import tarfile

import pytest
import zstandard

from openk3.sandbox.fs import naive, tree
from openk3.sandbox.protocol import InvalidArgument, Limits, NotFound

pytestmark = pytest.mark.sandbox

SETUP = (
    "mkdir -p /work/proj/src /work/gone && echo v1 > /work/proj/src/a.py && printf 'x%.0s' $(seq 3000) > /work/proj/big "
    "&& ln -s src/a.py /work/proj/link && chmod 600 /work/proj/src/a.py && rm /usr/bin/yes && rmdir /work/gone "
    "&& echo tmp > /tmp/t"
)
EDIT = (
    "echo v2 >> /work/proj/src/a.py && rm /work/proj/big && mkdir /work/new && echo n > /work/new/f "
    "&& rm -r /work/proj/src && mkdir /work/proj/src && echo replaced > /work/proj/src/b.py && chmod 700 /work/proj"
)


def swap_layer_bytes(archive: bytes, digest: str) -> bytes:
    """The same archive with one layer's content replaced by an empty layer: its digest no longer matches."""
    raw = zstandard.ZstdDecompressor().decompressobj().decompress(archive)
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(raw)) as src, tarfile.open(fileobj=out, mode="w") as dst:
        for m in src:
            data = src.extractfile(m).read()  # type: ignore[union-attr]
            if m.name == f"layers/{digest}.tar.zst":
                empty = io.BytesIO()
                with tarfile.open(fileobj=empty, mode="w"):
                    pass
                data = zstandard.ZstdCompressor().compress(empty.getvalue())
                m.size = len(data)
            dst.addfile(m, io.BytesIO(data))
    return zstandard.ZstdCompressor().compress(out.getvalue())


# Everything the tests change lives here; hashing the whole merged tree would re-read the base's 40 MB Python every time.
VIEW = ("etc", "root", "tmp", "work", "usr/bin")


def view(svc, sid: str) -> str:
    """Digest of the sandbox's mutable areas as the sandbox sees them (through the merged overlay): every entry must belong to
    its root, which is a host uid of its own (each instance has another), so owners count as that and nothing else."""
    root = svc.backend.merged_root(sid)
    uid = svc.backend.box(sid).uid or 0
    parts = []
    for part in VIEW:
        path = os.path.join(root, part)
        if not os.path.exists(path):
            parts.append("-")
            continue
        owners = {(st.st_uid, st.st_gid) for _, st in tree.walk_entries(path)}
        assert owners == {(uid, uid)}, (part, uid, owners)
        parts.append(tree.tree_digest(path, with_owner=False))
    return ",".join(parts)


def test_snapshot_restore_fork_semantics(svc, tmp_path):
    sid = svc.create()
    try:
        assert svc.exec(sid, SETUP).exit_code == 0
        at_snapshot = view(svc, sid)
        snap = svc.snapshot(sid)
        reference = str(tmp_path / "full-copy")
        naive.snapshot(os.path.join(svc.backend.merged_root(sid), "work"), reference)  # the slow definition: copy it all
        assert snap.kind.value == "fs" and len(snap.layers) == 1 and "file tree" in snap.captures
        assert svc.exec(sid, EDIT).exit_code == 0
        edited = view(svc, sid)
        assert edited != at_snapshot
        svc.restore(sid, snap.snapshot_id)
        assert view(svc, sid) == at_snapshot
        # The reference keeps the host uid of the instance it was copied from; the restored instance runs as another one
        # (view checked that its root owns everything).
        assert tree.tree_digest(os.path.join(svc.backend.merged_root(sid), "work"), with_owner=False) == tree.tree_digest(reference, with_owner=False)
        r = svc.exec(sid, "cat /work/proj/src/a.py /work/proj/link; test -e /usr/bin/yes || echo deleted; ls /work")
        assert r.stdout == b"v1\nv1\ndeleted\nproj\n"  # deletions (file and directory) survive the restore
        svc.exec(sid, EDIT)
        svc.restore(sid, snap.snapshot_id)
        assert view(svc, sid) == at_snapshot  # restoring twice gives identical trees

        a, b = svc.fork(snap.snapshot_id, 2)
        try:
            svc.exec(a, "echo only-a > /work/mine")
            assert svc.exec(b, "cat /work/mine").exit_code != 0  # forks are mutually invisible
            assert view(svc, b) == at_snapshot and view(svc, sid) == at_snapshot
            (c,) = svc.fork(a, 1)  # forking a live sandbox snapshots it first
            assert svc.exec(c, "cat /work/mine").stdout == b"only-a\n"
            assert svc.stats(c).layer_depth == 2
            svc.destroy(c)
        finally:
            svc.destroy(a)
            svc.destroy(b)
        with pytest.raises(InvalidArgument):
            svc.snapshot(sid, kind="process")
        with pytest.raises(NotFound):
            svc.restore(sid, "snap-missing@x")
    finally:
        svc.destroy(sid)
    svc.delete_snapshot(snap.snapshot_id)


def test_layers_are_content_addressed_and_refcounted(svc):
    a, b = svc.create(), svc.create()
    try:
        for sid in (a, b):
            svc.exec(sid, "echo same > /root/f && touch -d 2001-01-01 /root/f")
        s1, s2 = svc.snapshot(a), svc.snapshot(b)
        for s in (s1, s2):
            svc.backend.standbys.wait(s.snapshot_id)  # drop the prewarmed instances: count only the snapshots' references
        assert s1.layers == s2.layers  # same change set -> one shared layer
        assert svc.backend.store.refcounts()[s1.layers[0]] == 2
        svc.delete_snapshot(s1.snapshot_id)
        assert svc.backend.store.refcounts()[s1.layers[0]] == 1
        c = svc.create(s2.snapshot_id)
        svc.delete_snapshot(s2.snapshot_id)
        assert svc.exec(c, "cat /root/f").stdout == b"same\n"  # the sandbox still holds its layer
        svc.destroy(c)
        assert svc.backend.store.refcounts() == {}
    finally:
        svc.destroy(a)
        svc.destroy(b)


def test_deep_stacks_are_squashed_with_the_same_view(svc):
    sid = svc.create()
    snaps = []
    try:
        svc.exec(sid, "echo 0 > /root/counter && mkdir /root/d && echo keep > /root/d/k && rm /usr/bin/seq")
        for i in range(svc.backend.config.max_layers + 1):
            svc.exec(
                sid,
                f"echo {i} > /root/counter; echo {i} > /root/f{i % 3}; rm -f /root/f{(i + 1) % 3}"
                + ("; rm -r /root/d && mkdir /root/d && echo new > /root/d/n" if i == 20 else ""),
            )
            expected = view(svc, sid)
            before = svc.backend.box(sid).layers
            snap = svc.snapshot(sid)
            snaps.append(snap.snapshot_id)
            svc.restore(sid, snap.snapshot_id)
            assert view(svc, sid) == expected, i
        keep = svc.backend.config.max_layers // 2
        # Once deeper than max_layers the upper half is squashed into one layer; the bottom layers are kept, not copied.
        assert svc.stats(sid).layer_depth == keep + 1
        assert svc.backend.box(sid).layers[:keep] == before[:keep]
        assert svc.exec(sid, "ls /root/d; test -e /usr/bin/seq || echo gone").stdout == b"n\ngone\n"
    finally:
        svc.destroy(sid)
        for s in snaps:
            svc.delete_snapshot(s)


def test_tar_zst_round_trip_preserves_hashes(svc):
    sid = svc.create()
    try:
        svc.exec(sid, SETUP + " && mkdir /work/opaque && echo 1 > /work/opaque/x")
        snap = svc.snapshot(sid)
        svc.exec(sid, "rm -r /work/opaque && mkdir /work/opaque && echo 2 > /work/opaque/y")  # opaque dir in the upper
        snap2 = svc.snapshot(sid)
        expected = view(svc, sid)
    finally:
        svc.destroy(sid)
    archive = svc.export_snapshot(snap2.snapshot_id)
    digests = snap2.layers
    svc.delete_snapshot(snap2.snapshot_id)
    svc.delete_snapshot(snap.snapshot_id)
    assert svc.backend.store.refcounts() == {}  # layers gone: the import must rebuild them from the archive
    imported = svc.import_snapshot(archive)
    assert imported.layers == digests
    clone = svc.create(imported.snapshot_id)
    try:
        assert view(svc, clone) == expected
        assert svc.exec(clone, "ls /work/opaque").stdout == b"y\n"
        # a receiver that already has the layers gets only the manifest
        small = svc.export_snapshot(imported.snapshot_id, skip_layers=tuple(digests))
        again = svc.import_snapshot(small)
        assert again.layers == digests
        svc.delete_snapshot(again.snapshot_id)
    finally:
        svc.destroy(clone)
        svc.delete_snapshot(imported.snapshot_id)
    with pytest.raises(InvalidArgument):
        svc.import_snapshot(archive[:-200])
    with pytest.raises(InvalidArgument, match="does not match"):
        svc.import_snapshot(swap_layer_bytes(archive, digests[-1]))
    assert svc.backend.store.refcounts() == {}  # a rejected import takes no references


def test_prewarmed_standby_matches_limits_and_state(svc):
    sid = svc.create(limits=Limits(pids=64))
    try:
        svc.exec(sid, "echo s > /root/state")
        at_snapshot = view(svc, sid)
        snap = svc.snapshot(sid)  # prepares a standby built with pids=64
        child = svc.create(image=snap.snapshot_id)  # default limits: must not adopt the pids=64 standby
        try:
            assert pids_max(svc, child) == str(Limits().pids)
        finally:
            svc.destroy(child)
        for _ in range(3):  # repeated resets: each restore adopts the standby the previous one prepared
            svc.exec(sid, "rm /root/state; echo changed > /root/other")
            svc.restore(sid, snap.snapshot_id)
            assert view(svc, sid) == at_snapshot and pids_max(svc, sid) == "64"
            assert svc.exec(sid, "cat /root/state").stdout == b"s\n"
    finally:
        svc.destroy(sid)
    svc.delete_snapshot(snap.snapshot_id)


def pids_max(svc, sid: str) -> str:
    with open(f"{svc.backend.box(sid).cg.limit_dirs['pids']}/pids.max") as f:
        return f.read().strip()


def test_a_fork_of_a_snapshot_keeps_the_settings_it_was_taken_with(svc):
    """Issue: fork(snapshot_id) came back with default limits, env, workdir, services and labels (fork(sandbox_id) kept
    them). Both forks of the same state must now be the same sandbox."""
    settings = {
        "limits": Limits(pids=48, memory_bytes=96 << 20),
        "env": {"ROLE": "worker"},
        "workdir": "/tmp",
        "ttl_s": 4321.0,
        "services": ("echo started >> /tmp/service.log",),
        "labels": {"run": "r7"},
    }
    sid = svc.create(**settings)
    forks: list[str] = []
    try:
        snap = svc.snapshot(sid)
        svc.destroy(sid)  # the settings live with the snapshot, not with the sandbox it came from
        sid = ""
        forks = svc.fork(snap.snapshot_id, 2)
        for child in forks:
            assert pids_max(svc, child) == "48"
            assert svc.exec(child, "echo $ROLE; pwd").stdout == b"worker\n/tmp\n"
            meta = svc.backend._meta[child]
            assert (meta.ttl_s, meta.services, meta.limits) == (4321.0, settings["services"], settings["limits"])
        assert {i.sandbox_id for i in svc.list_sandboxes({"run": "r7"})} == set(forks)
        plain = svc.create(image=snap.snapshot_id)  # create() takes its own arguments: defaults unless given
        forks.append(plain)
        assert pids_max(svc, plain) == str(Limits().pids) and svc.exec(plain, "echo ${ROLE:-none}").stdout == b"none\n"
        svc.delete_snapshot(snap.snapshot_id)
    finally:
        for child in forks:
            svc.destroy(child)
        if sid:
            svc.destroy(sid)
