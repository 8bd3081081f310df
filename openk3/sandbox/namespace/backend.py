"""NamespaceBackend: the host daemon's sandboxes (lifecycle.py) plus their fs snapshots, restore, fork and import.

Snapshot (kind="fs") of a live sandbox: freeze its cgroup, copy the overlay upper (its change set, usually small) into scratch
space, thaw, then content-address the copy; the snapshot is the sandbox's stack plus that layer; deeper than `max_layers`, its upper
half is squashed into one layer. Restore: kill the sandbox's processes, remount the overlay over the snapshot's stack with an empty
upper, restart the init. Fork(n): snapshot once, create n sandboxes over it, with the settings (limits, env, workdir, TTL,
services, labels) of the sandbox the snapshot was taken from (snapshot_settings.py).

Persistence: every fs snapshot has a manifest on the state tmpfs (manifests.py), written before the snapshot is served and
removed before its layers are released, so a daemon killed at any point leaves no manifest naming a missing layer. A daemon
started on the dir of a killed one reloads the manifests, re-hashes each layer they name and discards (one log line each)
the snapshots whose layers do not verify; layers no manifest names (a snapshot cut short) are deleted.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
from collections.abc import Callable

from openk3.sandbox.fs import tree
from openk3.sandbox.linux import cgroups, syscalls
from openk3.sandbox.namespace.lifecycle import SandboxLifecycle
from openk3.sandbox.namespace.manifests import Manifests
from openk3.sandbox.namespace.settings import BackendConfig
from openk3.sandbox.namespace.snapshot_settings import SandboxSettings
from openk3.sandbox.protocol import InvalidArgument, NotFound, QuotaExceeded, SnapshotInfo, SnapshotKind

FS_CAPTURES = "file tree and metadata (incl. deletions); no process memory: restore restarts the init and recorded services"
# Called with the total bytes an operation will have added to the layer store, each time that total grows and before those
# bytes are written; raises QuotaExceeded to refuse (the caller's quota: see api/service.py).
Charge = Callable[[int], None]

logger = logging.getLogger(__name__)


class NamespaceBackend(SandboxLifecycle):
    def __init__(self, config: BackendConfig | None = None) -> None:
        super().__init__(config)
        self.manifests = Manifests(os.path.join(self.state, "snapshots"))
        self._settings: dict[str, SandboxSettings] = {}  # by snapshot id, for snapshots taken of a sandbox
        self._reload()

    def _reload(self) -> None:
        """Take back the snapshots a killed predecessor on this state dir recorded, those whose layers still verify."""
        infos, unreadable = self.manifests.load()
        for name, reason in unreadable:
            logger.warning("snapshot manifest %s discarded: %s", name, reason)
        refused = self.store.reopen({info.snapshot_id: info.layers for info, _ in infos})
        for info, settings in infos:
            if info.snapshot_id in refused:
                logger.warning("snapshot %s discarded: %s", info.snapshot_id, refused[info.snapshot_id])
                self.manifests.remove(info.snapshot_id)
                continue
            with self._lock:
                self._snapshots[info.snapshot_id] = info
                if settings is not None:
                    self._settings[info.snapshot_id] = settings
        if infos or unreadable:
            logger.warning("state dir %s: %d snapshots reloaded, %d discarded", self.state, len(infos) - len(refused), len(refused) + len(unreadable))

    def _record(self, info: SnapshotInfo, settings: SandboxSettings | None = None) -> None:
        """Write the manifest, then serve the snapshot; on failure the caller's layer references are given back."""
        try:
            self.manifests.write(info, settings)
        except OSError as e:
            self.store.decref(info.layers)
            if e.errno == errno.ENOSPC:
                raise QuotaExceeded(f"snapshot manifest: the state dir is full (store_bytes={self.config.store_bytes})") from e
            raise
        with self._lock:
            self._snapshots[info.snapshot_id] = info
            if settings is not None:
                self._settings[info.snapshot_id] = settings

    def _prepare_standby(self, sid: str, snap: SnapshotInfo) -> None:
        if self.config.prewarm:
            meta = self._meta[sid]
            self.standbys.prepare(snap.snapshot_id, self._params(meta), lambda: self._build(sid, snap.layers, meta.limits, meta.env, meta.workdir))

    def _charge(self, sid: str, total: int, charge: Charge | None) -> None:
        """Refuse, before writing, a snapshot that would take this sandbox's snapshots past limits.store_bytes or the caller
        past its quota (`charge`)."""
        limit = self._meta[sid].limits.store_bytes
        if limit is not None:
            with self._lock:
                held = sum(s.stored_bytes for s in self._snapshots.values() if s.source == sid)
            if held + total > limit:
                raise QuotaExceeded(
                    f"snapshot of {sid}: its snapshots hold {held} bytes of the layer store and this one needs {total} more, "
                    f"over limits.store_bytes={limit} (delete some of its snapshots)"
                )
        if charge is not None:
            charge(total)

    def snapshot(self, sid: str, prewarm: bool = True, charge: Charge | None = None) -> SnapshotInfo:
        box = self.box(sid)
        with box.lock:
            box.cg.freeze()
            try:
                upper = os.path.join(box.dir, "u")
                staged = None
                if os.listdir(upper):
                    # What the copy will allocate (holes are kept), charged and reserved before a byte is written.
                    need = tree.tree_size(upper)[1]
                    self._charge(sid, need, charge)
                    # The upper is the sandbox's own uid's; a layer is the canonical owner's, so any sandbox can mount it (uids.py).
                    ids = None if box.uid is None or self.uids is None else tree.IdShift(box.uid, self.uids.base)
                    staged = self.store.stage_copy(upper, need, ids)
            finally:
                box.cg.freeze(frozen=False)
            base_layers = box.layers
            self.store.incref(base_layers)
        layers, stored = base_layers, 0
        try:
            if staged is not None:
                layer, new = self.store.adopt(staged)
                layers, stored = base_layers + (layer.digest,), layer.bytes if new else 0
            if len(layers) > self.config.max_layers:
                # Squash only the upper half: the bottom layers (an image's, shared by every sandbox over it) stay as they are,
                # so a deep chain costs a copy of the recent change sets, not of the whole image, and the shared layers stay shared.
                keep = self.config.max_layers // 2
                self._charge(sid, stored + sum(self.store.get(d).bytes for d in layers[keep:]), charge)
                squashed, new = self.store.add_squash(list(layers[keep:]))
                self.store.decref(layers[keep:])
                layers, stored = layers[:keep] + (squashed.digest,), squashed.bytes if new else 0
        except BaseException:
            self.store.decref(layers)
            raise
        info = SnapshotInfo(
            snapshot_id=self._new_id("snap-"),
            kind=SnapshotKind.FS,
            layers=layers,
            source=sid,
            created_at=time.time(),
            captures=FS_CAPTURES,
            stored_bytes=stored,
        )
        meta = self._meta[sid]
        self._record(info, SandboxSettings(meta.limits, dict(meta.env), meta.workdir, meta.ttl_s, meta.services, dict(meta.labels)))
        if prewarm:
            self._prepare_standby(sid, info)
        return info

    def restore(self, sid: str, snapshot_id: str) -> None:
        """Swap the sandbox onto a fresh root over the snapshot's layers (its standby when one matches), then prepare the next."""
        snap = self.snapshot_info(snapshot_id)
        if snap.kind is not SnapshotKind.FS:
            raise InvalidArgument(f"snapshot_id={snapshot_id!r}: a {snap.kind.value} snapshot cannot restore a sandbox")
        old = self.box(sid)
        meta = self._meta[sid]
        fresh = self.standbys.take(snapshot_id, self._params(meta))
        if fresh is None:
            fresh = self._build(sid, snap.layers, meta.limits, meta.env, meta.workdir)
        fresh.sid = sid
        with old.lock:
            with self._lock:
                self._boxes[sid] = fresh
            self.standbys.retire(sid, old)
        self._prepare_standby(sid, snap)
        self._start_services(sid)

    def fork(self, source: str, n: int, charge: Charge | None = None) -> list[str]:
        """n sandboxes from a sandbox's current files (snapshotted once) or from an fs snapshot; each gets its own upper and
        the settings the source sandbox had (when the snapshot was taken), or the defaults for a snapshot that has none."""
        if not 1 <= n <= 1024:
            raise InvalidArgument(f"n={n}: expected 1..1024")
        own = source.startswith("sb-")
        snap = self.snapshot(source, prewarm=False, charge=charge) if own else self.snapshot_info(source)
        with self._lock:
            s = self._settings.get(snap.snapshot_id)
        try:
            if s is None:
                return [self.create(snap.snapshot_id) for _ in range(n)]
            return [self.create(snap.snapshot_id, s.limits, s.env, s.workdir, s.ttl_s, s.services, s.labels) for _ in range(n)]
        finally:
            if own:
                self.delete_snapshot(snap.snapshot_id)

    def delete_snapshot(self, snapshot_id: str) -> None:
        with self._lock:
            snap = self._snapshots.pop(snapshot_id, None)
            self._settings.pop(snapshot_id, None)
        if snap is None:
            raise NotFound(f"snapshot_id={snapshot_id!r}: no such snapshot on host {self.config.host}")
        self.manifests.remove(snapshot_id)
        self.standbys.wait(snapshot_id)
        self.store.decref(snap.layers)

    def register_snapshot(self, digests: list[str], held: list[str]) -> SnapshotInfo:
        """A snapshot of layers in the store: `held` are layers just imported (each verified against its digest when it was
        added, each carrying one reference that passes to the snapshot); the others must already be here."""
        spare = list(held)
        taken: list[str] = []
        try:
            for d in digests:
                if d in spare:
                    spare.remove(d)
                elif self.store.has(d):
                    self.store.incref([d])
                else:
                    raise NotFound(f"layer {d}: neither in this host's store nor in the archive")
                taken.append(d)
        except BaseException:
            self.store.decref(taken + spare)
            raise
        self.store.decref(spare)
        stored = sum(self.store.get(d).bytes for d in dict.fromkeys(held))
        info = SnapshotInfo(
            snapshot_id=self._new_id("snap-"),
            kind=SnapshotKind.FS,
            layers=tuple(digests),
            source="import",
            created_at=time.time(),
            captures=FS_CAPTURES,
            stored_bytes=stored,
        )
        self._record(info)
        return info

    def snapshots(self) -> list[SnapshotInfo]:
        with self._lock:
            return sorted(self._snapshots.values(), key=lambda s: s.created_at)

    def close(self, keep_snapshots: bool = False) -> None:
        """Destroy every sandbox and remove the daemon's cgroup subtree; then either delete every snapshot and unmount the
        store, or (keep_snapshots) leave the store mounted with its snapshots for the next daemon on this state dir."""
        self._closed = True
        for sid in self.sandboxes():
            self.destroy(sid)
        self.standbys.close()
        if self.uids is not None:
            self.uids.close()
        if keep_snapshots:
            self.store.check_integrity()
            cgroups.recover(self.layout, self.cg_prefix)
            self.state_dir.lock.release()
            return
        for snap in self.snapshots():
            self.delete_snapshot(snap.snapshot_id)
        self.store.check_integrity()
        self.state_dir.lock.release()  # its file is on the tmpfs: held open, it would keep the unmount busy
        syscalls.umount(self.state)
        shutil.rmtree(self.state, ignore_errors=True)
        cgroups.recover(self.layout, self.cg_prefix)
