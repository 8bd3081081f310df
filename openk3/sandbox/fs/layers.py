"""Immutable, refcounted, content-addressed layers on the daemon's tmpfs store.

Contract: a layer directory never changes after `add_*` returns; its name is its digest (see tree.tree_digest), so two
snapshots with the same change set share one directory. Every holder (a sandbox's stack, a snapshot) takes one reference per
layer with `incref` and gives it back with `decref`; the directory is deleted when the count reaches zero. All methods are
thread-safe (one lock; copying happens outside it into a private temporary directory).

Space: `Layer.bytes` is what a layer occupies (allocated bytes: holes are kept as holes). Before a copy writes anything it
reserves its size against the store's free space (`reserve`), so a snapshot that cannot fit fails at once, before it has
filled the store that every other caller's snapshots share; concurrent reservations are counted together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import shutil
import threading
import uuid
from collections.abc import Iterator
from typing import BinaryIO

from openk3.sandbox.fs import archive, layer_archive, tree
from openk3.sandbox.protocol import InvalidArgument, NotFound, QuotaExceeded

DIGEST_DIR_CHARS = 32  # enough to be unique, short enough to stack 32+ lowerdirs in one 4 KiB mount option string


@dataclasses.dataclass(frozen=True)
class Layer:
    digest: str
    path: str
    files: int
    bytes: int  # allocated on the store (holes not counted)


class LayerStore:
    def __init__(self, root: str) -> None:
        self.root = root
        self.tmp = os.path.join(root, ".tmp")
        # Root only: layers are shared by every sandbox over them and owned by the sandbox uid (their files come from uppers),
        # so a process of that uid outside its mount namespace must not be able to reach, let alone change, them.
        os.makedirs(self.tmp, mode=0o700, exist_ok=True)
        os.chmod(root, 0o700)
        self._lock = threading.Lock()
        self._layers: dict[str, Layer] = {}
        self._refs: dict[str, int] = {}
        self._reserved = 0

    def _scratch(self) -> str:
        return os.path.join(self.tmp, uuid.uuid4().hex)

    def free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    @contextlib.contextmanager
    def reserve(self, nbytes: int, what: str) -> Iterator[None]:
        """Hold `nbytes` of the store's free space while a copy of that size is written; QuotaExceeded, before anything is
        written, when it does not fit beside the other reservations."""
        with self._lock:
            free = self.free_bytes() - self._reserved
            if nbytes > free:
                raise QuotaExceeded(f"{what}: needs {nbytes} bytes in the layer store, which has {max(free, 0)} free")
            self._reserved += nbytes
        try:
            yield
        finally:
            with self._lock:
                self._reserved -= nbytes

    def _adopt(self, staged: str, digest: str | None = None) -> tuple[Layer, bool]:
        """Give a fully written scratch directory its content address (or drop it when that layer already exists); returns
        the layer with one reference taken, and whether it is new to the store."""
        digest = digest or tree.tree_digest(staged)
        with self._lock:
            if digest in self._layers:
                shutil.rmtree(staged)
                self._refs[digest] += 1
                return self._layers[digest], False
            files, size = tree.tree_size(staged)
            final = os.path.join(self.root, digest[:DIGEST_DIR_CHARS])
            os.rename(staged, final)
            layer = Layer(digest=digest, path=final, files=files, bytes=size)
            self._layers[digest] = layer
            self._refs[digest] = 1
            return layer, True

    def stage_copy(self, src: str, nbytes: int, ids: tree.IdShift | None = None) -> str:
        """Copy `src` (a frozen upper directory of `nbytes` allocated) into scratch space, within a reservation of that size,
        owners rewritten by `ids` if given; the caller thaws, then calls `adopt`. A store that fills anyway (holes the copy
        could not keep) is QuotaExceeded."""
        staged = self._scratch()
        try:
            with self.reserve(nbytes, "snapshot"):
                tree.copy_tree(src, staged, ids)
        except BaseException as e:
            shutil.rmtree(staged, ignore_errors=True)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise QuotaExceeded(f"snapshot: the layer store is full ({self.free_bytes()} bytes free)") from e
            raise
        return staged

    def adopt(self, staged: str) -> tuple[Layer, bool]:
        """Content-address a staged copy; returned with one reference taken, and whether it is new to the store."""
        return self._adopt(staged)

    def add_squash(self, digests: list[str]) -> tuple[Layer, bool]:
        """One layer with the overlay view of `digests` (bottom first); at most the sum of their sizes is reserved."""
        staged = self._scratch()
        try:
            with self.reserve(sum(self.get(d).bytes for d in digests), "layer squash"):
                tree.squash([self.get(d).path for d in digests], staged)
        except BaseException as e:
            shutil.rmtree(staged, ignore_errors=True)
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise QuotaExceeded(f"layer squash: the layer store is full ({self.free_bytes()} bytes free)") from e
            raise
        return self._adopt(staged)

    def add_archive(self, source: archive.Reader, budget: archive.Budget, expected_digest: str | None = None) -> Layer:
        """A layer from a tar.zst streamed from `source` (never held whole), within `budget`; one reference taken.

        It is unpacked into a private scratch directory (0700 root, like the store) and becomes a layer only once its digest
        matches: nothing of a refused archive is ever visible in the store, and nothing of any archive is written elsewhere
        (layer_archive.import_tar_zst follows no symlink)."""
        staged = self._scratch()
        try:
            layer_archive.import_tar_zst(source, staged, budget)
        except (ValueError, OSError, InvalidArgument) as e:
            shutil.rmtree(staged, ignore_errors=True)
            if isinstance(e, InvalidArgument):
                raise
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise QuotaExceeded(f"layer archive: the layer store is full ({self.free_bytes()} bytes free)") from e
            raise InvalidArgument(f"layer archive: {e}") from e
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise
        digest = tree.tree_digest(staged)
        if expected_digest is not None and digest != expected_digest:
            shutil.rmtree(staged)
            raise InvalidArgument(f"layer archive: content digest {digest} does not match the expected {expected_digest}")
        return self._adopt(staged, digest)[0]

    def reopen(self, stacks: dict[str, tuple[str, ...]]) -> dict[str, str]:
        """Take back the layers a previous daemon left in this store, for the snapshots `stacks` (id -> digests) it recorded.

        Each layer some stack names is re-hashed (tree.tree_digest) and kept only if its contents still match its name; each
        stack whose layers all verify takes one reference per layer, as a live snapshot does. Everything else (scratch copies
        of a snapshot cut short, layers no stack names, layers that fail) is deleted. Returns id -> reason for each stack refused.
        """
        wanted = {d for layers in stacks.values() for d in layers}
        by_dir = {d[:DIGEST_DIR_CHARS]: d for d in wanted}
        failed: dict[str, str] = {}
        found: dict[str, Layer] = {}
        shutil.rmtree(self.tmp)
        os.mkdir(self.tmp, 0o700)
        for name in sorted(os.listdir(self.root)):
            path = os.path.join(self.root, name)
            if name == ".tmp":
                continue
            digest = by_dir.get(name)
            if digest is None or not os.path.isdir(path) or os.path.islink(path):
                _remove(path)
                continue
            try:
                actual = tree.tree_digest(path)
            except OSError as e:
                actual = f"nothing ({e})"
            if actual != digest:
                failed[digest] = f"layer {digest}: its contents now hash to {actual}, not to its name (altered)"
                _remove(path)
                continue
            files, size = tree.tree_size(path)
            found[digest] = Layer(digest=digest, path=path, files=files, bytes=size)
        refused = {}
        with self._lock:
            assert not self._layers, "reopen is for a store that holds nothing yet"
            for sid, layers in stacks.items():
                bad = [failed.get(d, f"layer {d}: missing from the store") for d in layers if d not in found]
                if bad:
                    refused[sid] = bad[0]
                    continue
                for d in layers:
                    self._layers[d] = found[d]
                    self._refs[d] = self._refs.get(d, 0) + 1
            unused = [layer for d, layer in found.items() if d not in self._layers]
        for layer in unused:
            shutil.rmtree(layer.path)
        return refused

    def export(self, digest: str, out: BinaryIO) -> None:
        layer_archive.export_tar_zst(self.get(digest).path, out)

    def get(self, digest: str) -> Layer:
        with self._lock:
            if digest not in self._layers:
                raise NotFound(f"layer {digest!r}: not in this host's store")
            return self._layers[digest]

    def has(self, digest: str) -> bool:
        with self._lock:
            return digest in self._layers

    def incref(self, digests: list[str] | tuple[str, ...]) -> None:
        with self._lock:
            for d in digests:
                if d not in self._layers:
                    raise NotFound(f"layer {d!r}: not in this host's store")
            for d in digests:
                self._refs[d] += 1

    def decref(self, digests: list[str] | tuple[str, ...]) -> None:
        doomed = []
        with self._lock:
            for d in digests:
                self._refs[d] -= 1
                if self._refs[d] == 0:
                    doomed.append(self._layers.pop(d))
                    del self._refs[d]
        for layer in doomed:
            shutil.rmtree(layer.path)

    def refcounts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._refs)

    def check_integrity(self) -> None:
        """Every known layer has a directory and a positive count; no stray directories besides scratch space."""
        with self._lock:
            for d, layer in self._layers.items():
                assert self._refs[d] > 0, f"layer {d}: refcount {self._refs[d]}"
                assert os.path.isdir(layer.path), f"layer {d}: directory {layer.path} missing"
            names = {os.path.basename(layer.path) for layer in self._layers.values()}
            stray = set(os.listdir(self.root)) - names - {".tmp"}
            assert not stray, f"stray layer directories: {sorted(stray)}"


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)
