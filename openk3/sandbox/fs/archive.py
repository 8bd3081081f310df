"""Archives in bounded memory: tar (optionally zstd) streams checked against ArchiveLimits while they pass through.

Every archive the daemon reads or relays comes from a caller or a sandbox, so its size, member count, header sizes and
compression ratio are chosen by an attacker. `TarStream` reads one tar stream in chunks through a `_Gate` that counts raw
bytes and holds back what is not yet checked: a consumer (the sandbox's tar, an HTTP response) only ever receives the bytes
of members that passed `check_member`, plus the all-zero end of the archive. Headers (pax records, GNU long names, sparse
maps) may use at most HEADER_BUDGET bytes before the member they describe, so tarfile never buffers more than that. Sparse
members are relayed as they are (holes are never expanded here) and count at their apparent size, except where the reader
keeps holes as holes (a layer import, `holes_kept`): there they count the data they carry. What follows the last
member must be zeros: tarfile stops at a header it cannot parse where GNU tar would skip ahead, so anything after it could
otherwise reach the consumer unchecked.
"""

from __future__ import annotations

import dataclasses
import os
import tarfile
from collections.abc import Callable, Iterator
from typing import IO, Protocol, cast

import zstandard

from openk3.sandbox.protocol import ArchiveLimits, InvalidArgument

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
HEADER_BUDGET = 1 << 20  # extended headers and sparse maps before one member
CHUNK = 1 << 16
END_ZEROS = 2 * tarfile.BLOCKSIZE


class Reader(Protocol):
    def read(self, n: int = -1, /) -> bytes: ...


class ArchiveRefused(InvalidArgument):
    """An archive broke a limit or a rule; the message names which, and the value."""


@dataclasses.dataclass
class Budget:
    """Members and bytes counted across one transfer (for snapshots, every layer archive of it together).

    `charge`, when set, is called with the running byte total each time a member adds to it, before that member's data is
    written; it raises (QuotaExceeded) to stop the transfer there.
    """

    limits: ArchiveLimits
    what: str
    members: int = 0
    bytes: int = 0
    charge: Callable[[int], None] | None = None

    def add(self, name: str, size: int) -> None:
        lim = self.limits
        assert lim.max_members is not None and lim.max_bytes is not None and lim.max_member_bytes is not None
        self.members += 1
        if self.members > lim.max_members:
            raise ArchiveRefused(f"{self.what}: more than max_members={lim.max_members} members")
        if size > lim.max_member_bytes:
            raise ArchiveRefused(f"{self.what}: member {name!r} is {size} bytes, over max_member_bytes={lim.max_member_bytes}")
        self.bytes += size
        if self.bytes > lim.max_bytes:
            raise ArchiveRefused(f"{self.what}: members expand past max_bytes={lim.max_bytes}")
        if size and self.charge is not None:
            self.charge(self.bytes)


class _Gate:
    """The file object tarfile reads: counts raw bytes, refuses past `allow_until`, holds back bytes past `release_upto`."""

    def __init__(self, source: Reader, max_raw: int, what: str, relay: bool) -> None:
        self.source = source
        self.max_raw = max_raw
        self.what = what
        self.relay = relay
        self.pos = 0
        self.allow_until = HEADER_BUDGET + CHUNK
        self.release_upto = 0
        self.held = bytearray()
        self.out: list[bytes] = []

    def read(self, n: int = -1) -> bytes:
        n = CHUNK if n < 0 else n
        try:
            chunk = self.source.read(n)
        except zstandard.ZstdError as e:
            raise ArchiveRefused(f"{self.what}: zstd stream: {e} (max_window_bytes caps the decompression window)") from e
        self.pos += len(chunk)
        if self.pos > self.max_raw:
            raise ArchiveRefused(f"{self.what}: the uncompressed archive exceeds max_bytes={self.max_raw}")
        if self.pos > self.allow_until:
            raise ArchiveRefused(f"{self.what}: headers of one member exceed {HEADER_BUDGET} bytes")
        self.held += chunk
        self._release()
        return chunk

    def _release(self) -> None:
        start = self.pos - len(self.held)
        n = min(len(self.held), self.release_upto - start)
        if n > 0:
            if self.relay:
                self.out.append(bytes(self.held[:n]))
            del self.held[:n]

    def advance(self, upto: int) -> None:
        self.release_upto = upto
        self.allow_until = upto + HEADER_BUDGET + CHUNK
        self._release()

    def take(self) -> list[bytes]:
        out, self.out = self.out, []
        return out


def _refuse_pax(limit: int) -> type[tarfile.TarInfo]:
    class Checked(tarfile.TarInfo):
        def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
            ext = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
            if self.type in ext and self.size > limit:
                raise tarfile.ReadError(f"extended header of {self.size} bytes, over {limit}")
            return super()._proc_member(tarfile_)  # type: ignore[misc]

    return Checked


def sparse_map(m: tarfile.TarInfo) -> list[tuple[int, int]]:
    """(offset, length) of each data extent of a sparse member, as tarfile parsed them (typeshed calls the list bytes)."""
    assert m.sparse is not None
    return cast(list[tuple[int, int]], m.sparse)


def _bad_path(name: str) -> bool:
    parts = name.split("/")
    return name.startswith("/") or ".." in parts


class TarStream:
    """One tar stream read member by member; each member is checked before it is returned and before any byte of it is
    relayed. With `relay`, `chunks()` hands out the checked raw bytes (to pass the archive on unchanged)."""

    def __init__(self, source: Reader, budget: Budget, relay: bool = False, whiteouts: bool = False, holes_kept: bool = False) -> None:
        lim = budget.limits
        assert lim.max_bytes is not None and lim.max_path_bytes is not None
        self.budget = budget
        self.what = budget.what
        self.whiteouts = whiteouts
        self.holes_kept = holes_kept
        self.gate = _Gate(source, lim.max_bytes, budget.what, relay)
        try:
            self.tar = tarfile.open(fileobj=self.gate, mode="r|", bufsize=CHUNK, tarinfo=_refuse_pax(HEADER_BUDGET))  # type: ignore[call-overload]
        except tarfile.TarError as e:
            raise ArchiveRefused(f"{self.what}: not a tar archive ({e})") from e
        self.current: tarfile.TarInfo | None = None
        self.done = False

    def check_member(self, m: tarfile.TarInfo) -> None:
        lim = self.budget.limits
        assert lim.max_path_bytes is not None
        for label, value in (("name", m.name), ("link target", m.linkname)):
            if len(value.encode("utf-8", "surrogateescape")) > lim.max_path_bytes:
                raise ArchiveRefused(f"{self.what}: member {value[:80]!r}...: {label} longer than max_path_bytes={lim.max_path_bytes}")
        if _bad_path(m.name) or (m.islnk() and _bad_path(m.linkname)):
            raise ArchiveRefused(f"{self.what}: member {m.name!r}: expected a relative path inside the archive root, no '..'")
        if m.ischr() and self.whiteouts and (m.devmajor, m.devminor) == (0, 0):
            pass
        elif m.ischr() or m.isblk():
            raise ArchiveRefused(f"{self.what}: member {m.name!r}: device files are refused")
        elif not (m.isreg() or m.isdir() or m.issym() or m.islnk() or m.isfifo()):
            raise ArchiveRefused(f"{self.what}: member {m.name!r}: unsupported type {m.type!r}")
        size = m.size if m.isreg() else 0
        if m.sparse is not None:
            carried = self._check_sparse_map(m)
            size = carried if self.holes_kept else size
        self.budget.add(m.name, size)

    def _check_sparse_map(self, m: tarfile.TarInfo) -> int:
        """A sparse member's map must be ordered extents inside its length whose data fits the member's body; returns the
        bytes of data it carries."""
        end = 0
        for offset, length in sparse_map(m):
            if length == 0 and 0 <= offset <= m.size:
                continue  # GNU tar writes empty entries (a file of holes, or its end); they carry nothing
            if offset < end or length < 0 or offset + length > m.size:
                raise ArchiveRefused(
                    f"{self.what}: member {m.name!r}: sparse map entry ({offset}, {length}) is out of order, negative or past the file's length {m.size}"
                )
            end = offset + length
        carried = sum(length for _, length in sparse_map(m))
        if carried > self.tar.offset - m.offset_data:
            raise ArchiveRefused(f"{self.what}: member {m.name!r}: its sparse map names {carried} bytes of data, more than its body holds")
        return carried

    def next(self) -> tarfile.TarInfo | None:
        """The next checked member (its data readable with `extract` until the following call), or None at the end."""
        self._skip_data()
        try:
            m = self.tar.next()
        except (tarfile.TarError, EOFError, ValueError) as e:
            if isinstance(e, ArchiveRefused):
                raise
            raise ArchiveRefused(f"{self.what}: malformed tar: a header, pax record or sparse map could not be parsed ({type(e).__name__}: {e})") from e
        self.tar.members.clear()  # tarfile keeps every member; a stream needs none of them
        if m is None:
            self._finish()
            return None
        self.check_member(m)
        self.gate.advance(self.tar.offset)
        self.current = m
        return m

    def __iter__(self) -> Iterator[tarfile.TarInfo]:
        while (m := self.next()) is not None:
            yield m

    def extract(self, m: tarfile.TarInfo) -> IO[bytes]:
        f = self.tar.extractfile(m)
        if f is None:
            raise ArchiveRefused(f"{self.what}: member {m.name!r}: expected a regular file")
        return f

    def sparse_data(self, m: tarfile.TarInfo) -> Iterator[tuple[int, bytes]]:
        """A sparse member's data as (file offset, chunk), read straight from the stream: holes are never materialised."""
        fileobj = self.tar.fileobj
        assert fileobj is not None
        if fileobj.tell() != m.offset_data:
            fileobj.seek(m.offset_data)  # forward only: the map was read, the data follows
        for offset, length in sparse_map(m):
            while length > 0:
                chunk = fileobj.read(min(CHUNK, length))
                if not chunk:
                    raise ArchiveRefused(f"{self.what}: truncated member {m.name!r}")
                yield offset, chunk
                offset += len(chunk)
                length -= len(chunk)

    def _skip_data(self) -> None:
        """Read the current member's data up to the next header in chunks (so relayed bytes leave as they arrive)."""
        fileobj = self.tar.fileobj
        assert fileobj is not None
        while self.current is not None and (left := self.tar.offset - fileobj.tell()) > 0:
            if not fileobj.read(min(left, CHUNK)):
                raise ArchiveRefused(f"{self.what}: truncated member {self.current.name!r}")
            if self.gate.relay and len(self.gate.out) > 16:
                return  # let `chunks` hand these out first; it calls back until the member is done
        self.current = None

    def _finish(self) -> None:
        """Everything after the last member must be zeros (at least the two end blocks), then the source must end."""
        trailer = "data after the end of the archive (or a header tarfile could not parse)"
        seen = len(self.gate.held)
        if bytes(self.gate.held).strip(b"\0"):
            raise ArchiveRefused(f"{self.what}: {trailer}")
        self.gate.advance(self.gate.pos)
        while chunk := self.gate.read(CHUNK):
            if chunk.strip(b"\0"):
                raise ArchiveRefused(f"{self.what}: {trailer}")
            seen += len(chunk)
            if seen > HEADER_BUDGET:
                raise ArchiveRefused(f"{self.what}: more than {HEADER_BUDGET} bytes of padding after the end")
            self.gate.advance(self.gate.pos)
        if seen < END_ZEROS:
            raise ArchiveRefused(f"{self.what}: truncated (no end-of-archive blocks)")
        self.done = True

    def chunks(self) -> Iterator[bytes]:
        """Relay mode: the archive's bytes, in order, each released only once its member passed the checks."""
        self.done = False
        while True:
            if self.current is not None:
                self._skip_data()
            else:
                self.next()
            yield from self.gate.take()
            if self.done:
                return


def decompressed(source: Reader, limits: ArchiveLimits, what: str) -> Reader:
    """`source` as an uncompressed stream: zstd (recognised by its magic) is decoded in chunks, the window capped."""
    head = source.read(4)
    prefixed = _Prefixed(head, source)
    if head != ZSTD_MAGIC:
        return prefixed
    assert limits.max_window_bytes is not None
    dctx = zstandard.ZstdDecompressor(max_window_size=limits.max_window_bytes)
    return dctx.stream_reader(prefixed, read_size=CHUNK, read_across_frames=True)  # type: ignore[arg-type, return-value]


class _Prefixed:
    def __init__(self, head: bytes, rest: Reader) -> None:
        self.head = head
        self.rest = rest

    def read(self, n: int = -1) -> bytes:
        if self.head:
            out, self.head = self.head[:n] if n >= 0 else self.head, self.head[n:] if n >= 0 else b""
            return out
        return self.rest.read(n)


def relay(source: Reader, limits: ArchiveLimits, what: str) -> Iterator[bytes]:
    """The tar in `source` (zstd or plain), uncompressed, checked member by member, as chunks of at most a few CHUNKs."""
    stream = TarStream(decompressed(source, limits, what), Budget(limits, what), relay=True)
    yield from stream.chunks()


def write_all(fd: int) -> Callable[[bytes], None]:
    def write(data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]

    return write
