"""NamespaceBackend: the host daemon's sandboxes, snapshots and layers (the object model of docs/sandbox.md).

Objects: Layer (layers.py: immutable, refcounted, content-addressed), Snapshot (a SnapshotInfo: a list of layer digests, a
few hundred bytes), Sandbox (instance.py: a layer stack + upper + cgroups + init + limits + deadline). A sandbox holds one
reference to each layer of its stack, a snapshot one to each of its layers.

Snapshot (kind="fs") of a live sandbox: freeze its cgroup, copy the overlay upper (its change set, usually small) into scratch
space, thaw, then content-address the copy; the snapshot is the sandbox's stack plus that layer, squashed into one layer when
deeper than `max_layers`. Restore: kill the sandbox's processes, remount the overlay over the snapshot's stack with an empty
upper, restart the init. Fork(n): snapshot once, create n sandboxes over it.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import os
import shutil
import threading
import time
import uuid

from openk3.sandbox import cgroups, rootfs, syscalls
from openk3.sandbox.host import probe
from openk3.sandbox.instance import Instance
from openk3.sandbox.layers import LayerStore
from openk3.sandbox.proc import shell_quote
from openk3.sandbox.protocol import (
    Conflict,
    ExecResult,
    InvalidArgument,
    Limits,
    NotFound,
    QuotaExceeded,
    SandboxStats,
    SnapshotInfo,
    SnapshotKind,
    Unsupported,
)
from openk3.sandbox.settings import BackendConfig, check_traversable
from openk3.sandbox.standby import Standbys

FS_CAPTURES = "file tree and metadata (incl. deletions); no process memory: restore restarts the init and recorded services"


@dataclasses.dataclass
class _Meta:
    limits: Limits
    env: dict[str, str]
    workdir: str
    services: tuple[str, ...]
    expires_at: float
    ttl_s: float


class NamespaceBackend:
    def __init__(self, config: BackendConfig | None = None) -> None:
        config = config or BackendConfig()
        features = probe()
        if features.unavailable_reason:
            raise Unsupported(f"namespace sandboxes unavailable on this host: {features.unavailable_reason}")
        self.config = config
        self.layout = features.layout
        if config.cgroups == "v1":
            self.layout = dataclasses.replace(self.layout, v2_root=None, v2_controllers=frozenset())
            if self.layout.control_root is None:
                raise Unsupported("cgroups='v1': this host has no v1 freezer hierarchy")
        self.bwrap = features.bwrap
        self.base = rootfs.ensure_base(config.cache_dir, config.sandbox_uid or 0)
        self.instance_name = instance_name(config.state_dir)
        self.cg_prefix = f"openk3-sandbox/{self.instance_name}"
        self.state = os.path.realpath(config.state_dir)
        if config.sandbox_uid is not None:
            check_traversable(self.state, config.sandbox_uid)
        cgroups.recover(self.layout, self.cg_prefix)
        for point in sorted(syscalls.mounts_under(self.state), key=len, reverse=True):
            syscalls.umount(point, detach=True)  # a crashed daemon's mounts on this state dir
        os.makedirs(self.state, exist_ok=True)
        syscalls.mount("tmpfs", self.state, "tmpfs", syscalls.MS_NOSUID | syscalls.MS_NODEV, f"size={config.store_bytes},mode=0711")
        syscalls.make_private(self.state)
        os.makedirs(os.path.join(self.state, "sbx"))
        self.store = LayerStore(os.path.join(self.state, "layers"))
        self._lock = threading.Lock()
        self._boxes: dict[str, Instance] = {}
        self._meta: dict[str, _Meta] = {}
        self._snapshots: dict[str, SnapshotInfo] = {}
        self.standbys = Standbys(self._release)
        self._generation = itertools.count()
        self._closed = False

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}{uuid.uuid4().hex[:12]}@{self.config.host}"

    def box(self, sid: str) -> Instance:
        with self._lock:
            if sid not in self._boxes:
                raise NotFound(f"sandbox_id={sid!r}: no such sandbox on host {self.config.host}")
            return self._boxes[sid]

    def snapshot_info(self, snapshot_id: str) -> SnapshotInfo:
        with self._lock:
            if snapshot_id not in self._snapshots:
                raise NotFound(f"snapshot_id={snapshot_id!r}: no such snapshot on host {self.config.host}")
            return self._snapshots[snapshot_id]

    def create(
        self,
        image: str | None = None,
        limits: Limits | None = None,
        env: dict[str, str] | None = None,
        workdir: str = "/root",
        ttl_s: float | None = None,
        services: tuple[str, ...] = (),
    ) -> str:
        """A new sandbox over the base rootfs (image=None) or over an fs snapshot's layers (image=snapshot id)."""
        if self._closed:
            raise Conflict("backend is closed")
        limits = limits or Limits()
        layers: tuple[str, ...] = ()
        if image is not None:
            snap = self.snapshot_info(image)
            if snap.kind is not SnapshotKind.FS:
                raise InvalidArgument(f"image={image!r}: a {snap.kind.value} snapshot cannot seed a namespace sandbox")
            layers = snap.layers
        sid = self._new_id("sb-")
        ttl = self.config.default_ttl_s if ttl_s is None else ttl_s
        meta = _Meta(limits, dict(env or {}), workdir, tuple(services), time.time() + ttl, ttl)
        box = self.standbys.take(image, self._params(meta)) if image is not None else None
        if box is None:
            box = self._build(sid, layers, limits, meta.env, workdir)
        box.sid = sid
        with self._lock:
            self._boxes[sid] = box
            self._meta[sid] = meta
        self._start_services(sid)
        return sid

    def _build(self, sid: str, layers: tuple[str, ...], limits: Limits, env: dict[str, str], workdir: str) -> Instance:
        """Cgroups, tmpfs, overlay and a running init for `sid` over `layers`; takes one reference per layer."""
        name = f"{sid.split('@')[0]}-{next(self._generation)}"
        self.store.incref(layers)
        box = None
        cg = None
        try:
            cg = cgroups.CgroupSet(self.layout, self.cg_prefix, name)
            cg.set_limits(limits.memory_bytes, limits.pids, limits.cpus)
            box = Instance(
                sid,
                os.path.join(self.state, "sbx", name),
                self.base,
                layers,
                [self.store.get(d).path for d in layers],
                limits,
                cg,
                env,
                workdir,
                self.bwrap,
                self.config.sandbox_uid,
            )
            box.start_init()
            return box
        except BaseException:
            if box is not None:
                box.teardown()
            elif cg is not None:
                cg.remove()
            self.store.decref(layers)
            raise

    def _release(self, box: Instance) -> None:
        try:
            box.teardown()
        finally:
            self.store.decref(box.layers)

    def _params(self, meta: _Meta) -> tuple:
        return (meta.limits, tuple(sorted(meta.env.items())), meta.workdir)

    def _prepare_standby(self, sid: str, snap: SnapshotInfo) -> None:
        if self.config.prewarm:
            meta = self._meta[sid]
            self.standbys.prepare(snap.snapshot_id, self._params(meta), lambda: self._build(sid, snap.layers, meta.limits, meta.env, meta.workdir))

    def _start_services(self, sid: str) -> None:
        for command in self._meta[sid].services:
            self.exec(sid, f"nohup sh -c {shell_quote(command)} >/dev/null 2>&1 &", timeout_s=5.0)

    def exec(
        self,
        sid: str,
        cmd: str | list[str],
        timeout_s: float = 60.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | None = None,
        max_output_bytes: int = 1 << 20,
    ) -> ExecResult:
        if not 0 < timeout_s <= 86400:
            raise InvalidArgument(f"timeout_s={timeout_s}: expected 0 < timeout_s <= 86400")
        if max_output_bytes < 0:
            raise InvalidArgument(f"max_output_bytes={max_output_bytes}: expected >= 0")
        if isinstance(cmd, list) and not cmd:
            raise InvalidArgument("cmd=[]: expected a shell string or a non-empty argv list")
        return self.box(sid).exec(cmd, timeout_s, cwd, dict(env or {}), stdin, max_output_bytes)

    def snapshot(self, sid: str, prewarm: bool = True) -> SnapshotInfo:
        box = self.box(sid)
        with box.lock:
            box.cg.freeze()
            try:
                upper = os.path.join(box.dir, "u")
                staged = self.store.stage_copy(upper) if os.listdir(upper) else None
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise QuotaExceeded(f"snapshot of {sid}: the layer store is full (store_bytes={self.config.store_bytes})") from e
                raise
            finally:
                box.cg.freeze(frozen=False)
            base_layers = box.layers
            self.store.incref(base_layers)
        layers = base_layers
        if staged is not None:
            layers = base_layers + (self.store.adopt(staged).digest,)
        if len(layers) > self.config.max_layers:
            squashed = self.store.add_squash(list(layers)).digest
            self.store.decref(layers)
            layers = (squashed,)
        info = SnapshotInfo(snapshot_id=self._new_id("snap-"), kind=SnapshotKind.FS, layers=layers, source=sid, created_at=time.time(), captures=FS_CAPTURES)
        with self._lock:
            self._snapshots[info.snapshot_id] = info
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

    def fork(self, source: str, n: int) -> list[str]:
        """n sandboxes from a sandbox's current files (snapshotted once) or from an fs snapshot; each gets its own upper."""
        if not 1 <= n <= 1024:
            raise InvalidArgument(f"n={n}: expected 1..1024")
        own = source.startswith("sb-")
        snap = self.snapshot(source, prewarm=False) if own else self.snapshot_info(source)
        meta = self._meta[source] if own else None
        try:
            if meta is None:
                return [self.create(snap.snapshot_id) for _ in range(n)]
            return [self.create(snap.snapshot_id, meta.limits, meta.env, meta.workdir, meta.ttl_s, meta.services) for _ in range(n)]
        finally:
            if own:
                self.delete_snapshot(snap.snapshot_id)

    def delete_snapshot(self, snapshot_id: str) -> None:
        with self._lock:
            snap = self._snapshots.pop(snapshot_id, None)
        if snap is None:
            raise NotFound(f"snapshot_id={snapshot_id!r}: no such snapshot on host {self.config.host}")
        self.standbys.wait(snapshot_id)
        self.store.decref(snap.layers)

    def destroy(self, sid: str) -> None:
        with self._lock:
            box = self._boxes.pop(sid, None)
            meta = self._meta.pop(sid, None)
        if box is None or meta is None:
            raise NotFound(f"sandbox_id={sid!r}: no such sandbox on host {self.config.host}")
        try:
            box.teardown()
        finally:
            self.store.decref(box.layers)
            self.standbys.wait(sid)

    def stats(self, sid: str) -> SandboxStats:
        box = self.box(sid)
        meta = self._meta[sid]
        return SandboxStats(
            sandbox_id=sid,
            memory_bytes=box.cg.memory_bytes(),
            pids=box.cg.pid_count(),
            cpu_usage_s=box.cg.cpu_usage_s(),
            disk_used_bytes=box.disk_used(),
            disk_limit_bytes=meta.limits.disk_bytes,
            layer_depth=len(box.layers),
            alive=box.alive(),
            expires_at=meta.expires_at,
        )

    def heartbeat(self, sid: str, ttl_s: float | None = None) -> float:
        self.box(sid)
        with self._lock:
            meta = self._meta[sid]
            meta.ttl_s = meta.ttl_s if ttl_s is None else ttl_s
            meta.expires_at = time.time() + meta.ttl_s
            return meta.expires_at

    def expired(self, now: float | None = None) -> list[str]:
        """Sandboxes whose TTL passed without a heartbeat (the service destroys them, shells first)."""
        now = time.time() if now is None else now
        with self._lock:
            return sorted(sid for sid, m in self._meta.items() if m.expires_at <= now)

    def register_snapshot(self, digests: list[str], archives: dict[str, bytes | None]) -> SnapshotInfo:
        """A snapshot made of layers already here or shipped as tar.zst archives (each verified against its digest)."""
        taken: list[str] = []
        try:
            for d in digests:
                if self.store.has(d):
                    self.store.incref([d])
                elif archives.get(d) is None:
                    raise NotFound(f"layer {d}: neither in this host's store nor in the archive")
                else:
                    self.store.add_archive(archives[d] or b"", expected_digest=d)
                taken.append(d)
        except BaseException:
            self.store.decref(taken)
            raise
        info = SnapshotInfo(
            snapshot_id=self._new_id("snap-"), kind=SnapshotKind.FS, layers=tuple(digests), source="import", created_at=time.time(), captures=FS_CAPTURES
        )
        with self._lock:
            self._snapshots[info.snapshot_id] = info
        return info

    def sandboxes(self) -> list[str]:
        with self._lock:
            return sorted(self._boxes)

    def snapshots(self) -> list[SnapshotInfo]:
        with self._lock:
            return sorted(self._snapshots.values(), key=lambda s: s.created_at)

    def merged_root(self, sid: str) -> str:
        return self.box(sid).merged

    def close(self) -> None:
        """Destroy every sandbox and snapshot, unmount the store and remove the daemon's cgroup subtree."""
        self._closed = True
        for sid in self.sandboxes():
            self.destroy(sid)
        self.standbys.close()
        for snap in self.snapshots():
            self.delete_snapshot(snap.snapshot_id)
        self.store.check_integrity()
        syscalls.umount(self.state)
        shutil.rmtree(self.state, ignore_errors=True)
        cgroups.recover(self.layout, self.cg_prefix)


def instance_name(state_dir: str) -> str:
    """The daemon's cgroup subtree name: derived from its state dir, so a restart on the same dir finds a crashed run's."""
    return "i" + uuid.uuid5(uuid.NAMESPACE_URL, os.path.realpath(state_dir)).hex[:10]
