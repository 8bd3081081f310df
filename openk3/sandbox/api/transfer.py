"""Archive transfer in bounded memory: upload_tar, download_tar, export_snapshot and import_snapshot as streams.

No whole archive is ever held by the daemon. Uploads are decompressed in chunks, checked member by member (fs/archive.py)
and piped into the sandbox's own tar; downloads come out of the sandbox's `tar -c --sparse` through a pipe, are checked the
same way and leave as chunks; snapshot archives are read member by member, each layer unpacked into the store as it streams,
and written from spooled layer archives on the store's tmpfs. Each transfer costs a few chunks of memory (CHUNK, 64 KiB,
plus at most HEADER_BUDGET of headers), whatever the archive expands to.
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
import tempfile
import threading
from collections.abc import Iterator

import zstandard

from openk3.sandbox.fs import archive
from openk3.sandbox.namespace.backend import Charge, NamespaceBackend
from openk3.sandbox.protocol import ArchiveLimits, ExecResult, InvalidArgument, QuotaExceeded, SandboxError, SnapshotInfo

TAR_TIMEOUT_S = 300.0
MAX_MANIFEST_BYTES = 1 << 20
LAYER_MEMBER = re.compile(r"layers/([0-9a-f]{64})\.tar\.zst")


def _failed(what: str, r: ExecResult) -> SandboxError:
    said = r.stderr.decode(errors="replace").strip()
    if "No space left on device" in said or "Disk quota exceeded" in said:
        # The sandbox's disk (its limits.disk_bytes or inodes) is full: a quota, not a bad archive.
        return QuotaExceeded(f"{what} failed: the sandbox's disk is full: {said[-500:]}")
    return InvalidArgument(f"{what} failed: {said or f'tar exited {r.exit_code}'}")


def upload_tar(backend: NamespaceBackend, sandbox_id: str, source: archive.Reader, dest: str, limits: ArchiveLimits) -> None:
    """Relay the checked, uncompressed tar from `source` into `tar -x` inside the sandbox (which keeps paths inside it)."""
    backend.box(sandbox_id)
    what = f"upload_tar to {dest!r}"
    r, w = os.pipe()
    failure: list[BaseException] = []

    def feed() -> None:
        write = archive.write_all(w)
        try:
            for chunk in archive.relay(source, limits, what):
                write(chunk)
        except BrokenPipeError:
            pass  # the sandbox's tar stopped reading: its exit status says why
        except BaseException as e:  # handed to the caller below
            failure.append(e)
        finally:
            os.close(w)

    feeder = threading.Thread(target=feed, name="upload_tar", daemon=True)
    feeder.start()
    try:
        result = backend.exec(sandbox_id, ["tar", "-x", "--no-same-owner", "-f", "-", "-C", dest], stdin=r, timeout_s=TAR_TIMEOUT_S)
    finally:
        os.close(r)  # a feeder still writing gets EPIPE
        feeder.join()
    if failure:
        err = failure[0]
        if isinstance(err, SandboxError):
            raise err
        raise InvalidArgument(f"{what}: reading the archive failed: {type(err).__name__}: {err}") from err
    if result.exit_code != 0:
        if backend.box(sandbox_id).disk_full():
            # GNU tar often says only "Wrote only N of M bytes": the full disk is why, and it is a quota (507), not bad input.
            said = result.stderr.decode(errors="replace").strip()[-300:]
            raise QuotaExceeded(f"{what} failed: the sandbox's disk is full (limits.disk_bytes / limits.inodes): {said}")
        raise _failed(what, result)


def download_tar(backend: NamespaceBackend, sandbox_id: str, path: str, limits: ArchiveLimits) -> Iterator[bytes]:
    """The tar of `path` inside the sandbox, as checked chunks; sparse files stay sparse and count at their apparent size."""
    backend.box(sandbox_id)
    what = f"download_tar of {path!r}"
    r, w = os.pipe()
    outcome: list[ExecResult | BaseException] = []

    def run() -> None:
        try:
            argv = ["tar", "-c", "--sparse", "-f", "-", "-C", path, "."]
            outcome.append(backend.exec(sandbox_id, argv, timeout_s=TAR_TIMEOUT_S, stdout_fd=w))
        except BaseException as e:  # handed to the caller below
            outcome.append(e)
        finally:
            os.close(w)

    runner = threading.Thread(target=run, name="download_tar", daemon=True)
    runner.start()
    reader = os.fdopen(r, "rb", buffering=0)
    try:
        try:
            yield from archive.relay(reader, limits, what)
        except archive.ArchiveRefused:
            # The pipe reaches EOF only after `run` recorded tar's exit, so a recorded failure is why the archive stopped
            # short (no such path); otherwise tar is still writing and the refusal stands (closing the pipe stops it).
            done = outcome[0] if outcome else None
            if isinstance(done, ExecResult) and done.exit_code != 0:
                raise _failed(what, done) from None
            raise
        runner.join()
    finally:
        reader.close()  # a tar still writing gets EPIPE and exits
        runner.join()
    done = outcome[0]
    if isinstance(done, BaseException):
        raise done
    if done.exit_code != 0:
        raise _failed(what, done)


def _tar_member(z: zstandard.ZstdCompressionObj, name: str, f: archive.Reader, size: int) -> Iterator[bytes]:
    info = tarfile.TarInfo(name)
    info.size = size
    yield z.compress(info.tobuf(tarfile.USTAR_FORMAT))
    while chunk := f.read(1 << 20):
        yield z.compress(chunk)
    yield z.compress(b"\0" * (-size % tarfile.BLOCKSIZE))


def export_snapshot(backend: NamespaceBackend, snapshot_id: str, skip_layers: tuple[str, ...]) -> Iterator[bytes]:
    """tar.zst of a manifest and each layer not skipped (itself a tar.zst, spooled on the store's tmpfs), in chunks."""
    snap = backend.snapshot_info(snapshot_id)
    backend.store.incref(snap.layers)  # a concurrent delete_snapshot must not remove a layer mid-export
    try:
        z = zstandard.ZstdCompressor(level=1).compressobj()
        manifest = json.dumps({"layers": list(snap.layers), "captures": snap.captures}).encode()
        yield from filter(None, _tar_member(z, "manifest.json", io.BytesIO(manifest), len(manifest)))
        for digest in dict.fromkeys(snap.layers):
            if digest in skip_layers:
                continue
            with tempfile.TemporaryFile(dir=backend.store.tmp) as f:
                backend.store.export(digest, f)
                size = f.tell()
                f.seek(0)
                yield from filter(None, _tar_member(z, f"layers/{digest}.tar.zst", f, size))
        yield z.compress(b"\0" * archive.END_ZEROS) + z.flush()
    finally:
        backend.store.decref(snap.layers)


def import_snapshot(backend: NamespaceBackend, source: archive.Reader, limits: ArchiveLimits, charge: Charge | None = None) -> SnapshotInfo:
    """Unpack each shipped layer into the store as it streams (verified against its digest), then register the snapshot;
    `charge` sees the running total of the layers' data before each file of it is written."""
    what = "snapshot archive"
    stream = archive.TarStream(archive.decompressed(source, limits, what), archive.Budget(limits, what))
    first = stream.next()
    if first is None or first.name != "manifest.json" or not first.isreg() or first.size > MAX_MANIFEST_BYTES:
        raise InvalidArgument(f"{what}: expected manifest.json (at most {MAX_MANIFEST_BYTES} bytes) as its first member")
    try:
        digests = json.loads(stream.extract(first).read())["layers"]
    except (ValueError, KeyError, TypeError) as e:
        raise InvalidArgument(f'{what}: manifest.json: expected {{"layers": [digest, ...]}} ({e})') from e
    if not isinstance(digests, list) or not all(isinstance(d, str) and re.fullmatch("[0-9a-f]{64}", d) for d in digests):
        raise InvalidArgument(f"{what}: manifest.json: layers must be a list of sha256 hex digests")
    layers = archive.Budget(limits, f"{what}: layers", charge=charge)  # every layer archive's members count against one budget
    held: list[str] = []
    try:
        for m in stream:
            match = LAYER_MEMBER.fullmatch(m.name)
            if match is None or match.group(1) not in digests or not m.isreg():
                raise InvalidArgument(f"{what}: member {m.name!r}: expected layers/<digest>.tar.zst of a layer in the manifest")
            digest = match.group(1)
            if digest in held or backend.store.has(digest):
                continue
            backend.store.add_archive(stream.extract(m), layers, expected_digest=digest)
            held.append(digest)
    except BaseException:
        backend.store.decref(held)
        raise
    return backend.register_snapshot(digests, held)
