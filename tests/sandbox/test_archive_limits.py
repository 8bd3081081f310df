"""Archives in bounded memory (issue 18 item 6): zstd bombs, sparse files, member limits, per-call lowering, hostile members.

Memory is measured as the growth of this process's peak RSS (VmHWM, reset through /proc/self/clear_refs before each
transfer) over its RSS at the start: the daemon's code runs in process here. MEMORY_BOUND is generous (the transfers
buffer a few 64 KiB chunks and an 8 MiB zstd window); the archives expand to 1 GiB and more, and a 4 GiB sparse file.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import tarfile
from collections.abc import Callable

import pytest
import zstandard

from openk3.sandbox.api.client import AsyncSandboxClient, SandboxClient
from openk3.sandbox.api.server import create_app
from openk3.sandbox.fs import archive
from openk3.sandbox.namespace.settings import DEFAULT_ARCHIVE_LIMITS
from openk3.sandbox.protocol import ArchiveLimits, InvalidArgument
from tests.sandbox.test_api import running

MEMORY_BOUND = 96 * 2**20
GIB = 2**30


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"{field} not in /proc/self/status")


def peak_growth(fn: Callable[[], object]) -> int:
    """Bytes the peak RSS rose above the RSS before `fn` while it ran (exceptions from `fn` propagate after measuring)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _status_kib("VmRSS")
    try:
        fn()
    finally:
        growth = _status_kib("VmHWM") - base
        peak_growth.last = growth  # type: ignore[attr-defined]
    return growth


def refused_within_bound(fn: Callable[[], object], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        peak_growth(fn)
    assert peak_growth.last < MEMORY_BOUND, f"peak RSS grew {peak_growth.last >> 20} MiB"  # type: ignore[attr-defined]


def tar_bytes(members: list[tuple[str, bytes]], **kw: object) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            for k, v in kw.items():
                setattr(info, k, v)
            tar.addfile(info, io.BytesIO(data))
    return raw.getvalue()


def zstd_tar_of_zeros(sizes: list[int]) -> bytes:
    """A small zstd frame holding a tar of members of zeros of the given sizes (never built uncompressed)."""
    z = zstandard.ZstdCompressor(level=3).compressobj()
    out, zeros = [], bytes(1 << 20)
    for i, size in enumerate(sizes):
        info = tarfile.TarInfo(f"zero{i}")
        info.size = size
        out.append(z.compress(info.tobuf(tarfile.USTAR_FORMAT)))
        left = size + (-size % tarfile.BLOCKSIZE)
        while left:
            n = min(left, len(zeros))
            out.append(z.compress(zeros[:n]))
            left -= n
    out.append(z.compress(bytes(archive.END_ZEROS)) + z.flush())
    return b"".join(out)


@pytest.fixture(scope="module")
def bomb() -> bytes:
    data = zstd_tar_of_zeros([64 * 2**20] * 16)  # 1 GiB in 16 members, each under every single-member limit
    assert len(data) < 256 * 2**10
    return data


def lowered(**kw: int) -> ArchiveLimits:
    return ArchiveLimits(**kw).within(DEFAULT_ARCHIVE_LIMITS)


def relay_all(data: bytes, limits: ArchiveLimits = DEFAULT_ARCHIVE_LIMITS) -> bytes:
    return b"".join(archive.relay(io.BytesIO(data), limits, "test archive"))


# the checks themselves, no sandbox needed


def drain(data: bytes, limits: ArchiveLimits = DEFAULT_ARCHIVE_LIMITS) -> int:
    """Relay and drop (what a consumer of the stream does), so only the relay's own memory is measured."""
    return sum(len(chunk) for chunk in archive.relay(io.BytesIO(data), limits, "test archive"))


def test_limits_lower_but_never_raise():
    assert lowered(max_members=3).max_members == 3 and lowered(max_members=3).max_bytes == DEFAULT_ARCHIVE_LIMITS.max_bytes
    with pytest.raises(InvalidArgument, match=r"limits.max_bytes=2147483648: expected <= 1073741824"):
        lowered(max_bytes=2 * GIB)
    with pytest.raises(InvalidArgument, match="max_members=0"):
        ArchiveLimits(max_members=0)


def test_relay_passes_good_archives_unchanged():
    data = tar_bytes([("d/a", b"x" * 5000), ("d/b", b"")])
    assert relay_all(data) == data
    assert relay_all(zstandard.ZstdCompressor().compress(data)) == data


def test_zstd_bomb_is_refused_in_bounded_memory(bomb):
    refused_within_bound(lambda: drain(bomb, lowered(max_bytes=256 * 2**20)), "max_bytes=268435456")
    refused_within_bound(lambda: drain(bomb), "max_bytes=1073741824")
    refused_within_bound(lambda: drain(zstd_tar_of_zeros([2 * GIB])), "over max_member_bytes")
    # a frame of nothing but zeros (the 32 KiB -> 1 GiB): an empty tar followed by endless padding
    zeros = zstandard.ZstdCompressor(level=19).compress(bytes(256 * 2**20))
    refused_within_bound(lambda: drain(zeros), "padding after the end")


def test_zstd_window_is_capped():
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=24)
    z = zstandard.ZstdCompressor(compression_params=params).compressobj()  # streamed: the frame declares a 16 MiB window
    data = z.compress(tar_bytes([("a", b"y" * 1000)])) + z.flush()
    assert relay_all(data, dataclasses.replace(DEFAULT_ARCHIVE_LIMITS, max_window_bytes=16 * 2**20)) == tar_bytes([("a", b"y" * 1000)])
    with pytest.raises(InvalidArgument, match="max_window_bytes"):
        relay_all(data)  # the default cap is 8 MiB
    with pytest.raises(InvalidArgument, match="max_window_bytes"):
        relay_all(zstandard.ZstdCompressor().compress(tar_bytes([("a", b"y" * 1000)]) * 3), lowered(max_window_bytes=1024))


def test_member_count_size_and_path_limits():
    data = tar_bytes([(f"f{i}", b"z" * 100) for i in range(10)])
    with pytest.raises(InvalidArgument, match="more than max_members=5"):
        relay_all(data, lowered(max_members=5))
    with pytest.raises(InvalidArgument, match="over max_member_bytes=99"):
        relay_all(data, lowered(max_member_bytes=99))
    with pytest.raises(InvalidArgument, match="max_bytes=500"):
        relay_all(data, lowered(max_bytes=500))
    with pytest.raises(InvalidArgument, match="longer than max_path_bytes=64"):
        relay_all(tar_bytes([("d/" + "n" * 100, b"")]), lowered(max_path_bytes=64))


@pytest.mark.parametrize(
    "members, kw, match",
    [
        ([("/etc/x", b"")], {}, "relative path"),
        ([("a/../../x", b"")], {}, "relative path"),
        ([("dev", b"")], {"type": tarfile.CHRTYPE, "devmajor": 1, "devminor": 3}, "device files"),
        ([("blk", b"")], {"type": tarfile.BLKTYPE}, "device files"),
        ([("h", b"")], {"type": tarfile.LNKTYPE, "linkname": "../../etc/passwd"}, "relative path"),
    ],
)
def test_hostile_members_are_refused(members, kw, match):
    with pytest.raises(InvalidArgument, match=match):
        relay_all(tar_bytes(members, **kw))


def test_trailing_data_truncation_and_huge_headers_are_refused():
    data = tar_bytes([("a", b"1" * 600)])
    with pytest.raises(InvalidArgument, match="after the end"):
        relay_all(data + tar_bytes([("hidden", b"2")]))  # bytes past the end marker never reach a consumer
    with pytest.raises(InvalidArgument, match="truncated"):
        relay_all(data[:1024])
    with pytest.raises(InvalidArgument, match="truncated"):
        relay_all(data[:1536])  # the member's data complete, no end blocks
    pax = tar_bytes([("a", b"")], pax_headers={"comment": "c" * (2 * 2**20)})
    with pytest.raises(InvalidArgument, match="extended header of 2097169 bytes"):
        relay_all(pax)
    with pytest.raises(InvalidArgument, match="extended header of 2097169 bytes"):
        relay_all(data[:1536] + pax)  # as a later member, too


# through a daemon's service


def export_with_layer(svc, layer_archive: bytes, digest: str) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for name, data in (("manifest.json", json.dumps({"layers": [digest]}).encode()), (f"layers/{digest}.tar.zst", layer_archive)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return zstandard.ZstdCompressor().compress(raw.getvalue())


@pytest.mark.sandbox
def test_upload_and_import_of_bombs_stay_bounded(svc, bomb):
    sid = svc.create()
    try:
        refused_within_bound(lambda: svc.upload_tar(sid, bomb, "/root", limits=ArchiveLimits(max_bytes=128 * 2**20)), "max_bytes=134217728")
        refused_within_bound(lambda: svc.upload_tar(sid, bomb, "/root"), "max_bytes=1073741824")
        assert svc.exec(sid, "echo ok").stdout == b"ok\n"
    finally:
        svc.destroy(sid)
    outer = export_with_layer(svc, bomb, "0" * 64)  # the layer is the bomb; the outer archive stays small
    refused_within_bound(lambda: svc.import_snapshot(outer), "max_bytes=1073741824")
    refused_within_bound(lambda: svc.import_snapshot(zstd_tar_of_zeros([GIB])), "manifest.json")
    assert svc.backend.store.refcounts() == {}


@pytest.mark.sandbox
def test_upload_limits_per_call(svc):
    sid = svc.create()
    try:
        data = tar_bytes([(f"w/f{i}", b"q" * 100) for i in range(10)])
        with pytest.raises(InvalidArgument, match="max_members=5"):
            svc.upload_tar(sid, data, "/root", limits=ArchiveLimits(max_members=5))
        with pytest.raises(InvalidArgument, match="callers may only lower"):
            svc.upload_tar(sid, data, "/root", limits=ArchiveLimits(max_members=10**9))
        svc.upload_tar(sid, io.BytesIO(zstandard.ZstdCompressor().compress(data)), "/root", limits=ArchiveLimits(max_members=11))
        assert svc.exec(sid, "ls /root/w | wc -l").stdout == b"10\n"
        with pytest.raises(InvalidArgument, match="device files"):
            svc.upload_tar(sid, tar_bytes([("dev", b"")], type=tarfile.CHRTYPE, devmajor=1, devminor=3), "/root")
    finally:
        svc.destroy(sid)


@pytest.mark.sandbox
def test_download_of_a_4gib_sparse_file_stays_bounded(svc, monkeypatch):
    sid = svc.create()
    try:
        assert (
            svc.exec(
                sid,
                "python3 -c \"f = open('/root/sparse', 'wb'); f.truncate(4 << 30); f.seek(0, 2); f.write(b'tail\\n')\" && mkdir /root/d && echo x > /root/d/f",
            ).exit_code
            == 0
        )
        refused_within_bound(lambda: svc.download_tar(sid, "/root"), "'./sparse' is 4294967301 bytes, over max_member_bytes=1073741824")
        roomy = dataclasses.replace(DEFAULT_ARCHIVE_LIMITS, max_bytes=8 * GIB, max_member_bytes=8 * GIB)
        monkeypatch.setattr(svc.backend, "config", dataclasses.replace(svc.backend.config, archive_limits=roomy))
        got: list[bytes] = []
        assert peak_growth(lambda: got.extend(svc.download_tar_stream(sid, "/root"))) < MEMORY_BOUND
        data = b"".join(got)
        assert len(data) < 4 * 2**20  # holes are not expanded on the way
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            sizes = {m.name: m.size for m in tar if m.isreg()}
        assert sizes == {"./sparse": 4 * GIB + 5, "./d/f": 2}
        with pytest.raises(InvalidArgument, match="more than max_members=2"):
            svc.download_tar(sid, "/root", limits=ArchiveLimits(max_members=2))
        with pytest.raises(InvalidArgument, match="callers may only lower"):
            svc.download_tar(sid, "/root", limits=ArchiveLimits(max_bytes=16 * GIB))
        with pytest.raises(InvalidArgument, match="download_tar of '/nope' failed"):
            svc.download_tar(sid, "/nope")
    finally:
        svc.destroy(sid)


@pytest.mark.sandbox
def test_archives_stream_over_http(svc, bomb):
    with running(create_app(svc, workers=4, reap_interval_s=None)) as url, SandboxClient(url) as c:
        sid = c.create()
        try:
            data = tar_bytes([("w/a", bytes(range(256)) * 800), ("w/b", b"b" * 300_000)])
            c.upload_tar(sid, io.BytesIO(zstandard.ZstdCompressor().compress(data)), "/root", limits=ArchiveLimits(max_members=3))
            out = io.BytesIO()
            assert c.download_tar(sid, "/root/w", out=out) is None
            with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as tar:
                assert tar.extractfile("./a").read() == bytes(range(256)) * 800  # type: ignore[union-attr]
            with pytest.raises(InvalidArgument, match="max_bytes=400000"):  # refused part way: an error frame ends the stream
                c.download_tar(sid, "/root/w", limits=ArchiveLimits(max_bytes=400_000))
            with pytest.raises(InvalidArgument, match="callers may only lower"):
                c.upload_tar(sid, data, "/root", limits=ArchiveLimits(max_bytes=4 * GIB))
            with pytest.raises(InvalidArgument, match="max_bytes=1073741824"):
                c.upload_tar(sid, bomb, "/root")
            with pytest.raises(InvalidArgument, match="manifest.json"):
                c.import_snapshot(bomb)
            snap = c.snapshot(sid)
            try:
                exported = c.export_snapshot(snap.snapshot_id)

                async def round_trip():
                    async with AsyncSandboxClient(url) as a:
                        assert await a.download_tar(sid, "/root/w") == out.getvalue()
                        return await a.import_snapshot(io.BytesIO(exported), limits=ArchiveLimits(max_members=1000))

                again = asyncio.run(round_trip())
                assert again.layers == snap.layers
                c.delete_snapshot(again.snapshot_id)
            finally:
                c.delete_snapshot(snap.snapshot_id)
        finally:
            c.destroy(sid)
