"""SandboxLifecycle: a host daemon's namespace sandboxes from start-up to destroy (the object model of docs/sandbox.md).

Objects: Layer (fs/layers.py: immutable, refcounted, content-addressed), Snapshot (a SnapshotInfo: a list of layer digests, a
few hundred bytes), Sandbox (instance.py: a layer stack + upper + cgroups + init + limits + deadline). A sandbox holds one
reference to each layer of its stack, a snapshot one to each of its layers.

This class owns the tables (sandboxes, their metadata, snapshots) and the sandbox half of the API: create, exec, stats,
heartbeat and destroy. NamespaceBackend (backend.py) adds fs snapshots, restore, fork and import on top of it.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
import time
import uuid
from collections.abc import Callable

from openk3.sandbox.fs import rootfs
from openk3.sandbox.fs.layers import LayerStore
from openk3.sandbox.linux import cgroups, helper, seccomp
from openk3.sandbox.linux.host import probe
from openk3.sandbox.linux.proc import OnOutput, shell_quote
from openk3.sandbox.namespace import recovery, statedir
from openk3.sandbox.namespace.instance import Instance
from openk3.sandbox.namespace.settings import BackendConfig, check_traversable, check_unshared_id
from openk3.sandbox.namespace.standby import Standbys
from openk3.sandbox.namespace.uids import UidPool, running_uids
from openk3.sandbox.protocol import (
    Conflict,
    ExecResult,
    InvalidArgument,
    Limits,
    NotFound,
    SandboxInfo,
    SandboxStats,
    SnapshotInfo,
    SnapshotKind,
    Unsupported,
    check_labels,
)


@dataclasses.dataclass
class _Meta:
    limits: Limits
    env: dict[str, str]
    workdir: str
    services: tuple[str, ...]
    expires_at: float
    ttl_s: float
    labels: dict[str, str]
    image: str | None
    created_at: float


class SandboxLifecycle:
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
        if config.sandbox_uid is not None:
            check_unshared_id(config.sandbox_uid, config.sandbox_uids)
        # The cache holds the helper the daemon runs as root and the base of every sandbox: only root may be able to change it.
        helper.check_private_dir(config.cache_dir, "cache_dir")
        self.helper = helper.Helper(helper.build(config.cache_dir), seccomp.program().hex())
        self.base = rootfs.ensure_base(config.cache_dir, config.sandbox_uid or 0)
        self.state = os.path.realpath(config.state_dir)
        if config.sandbox_uid is not None:
            check_traversable(self.state)
        # The state tmpfs and its instance name: fresh, or a killed predecessor's taken back with its layers and snapshot
        # manifests (backend.py reloads those) after its sandboxes' mounts, processes and cgroups are gone (statedir.py).
        self.state_dir = statedir.open_state(self.state, self.layout, config.store_bytes, config.sandbox_uid)
        self.instance_name = self.state_dir.name
        self.cg_prefix = recovery.cgroup_prefix(self.instance_name)
        # Other dead instances (a daemon killed on another state dir, or on this one before it was moved) leave mounts and
        # cgroups that no start on their own dir may ever clean: remove them here.
        recovery.clean_dead_instances(self.layout, keep=self.instance_name)
        # Made once those are gone (see uids.py): an id still running a process now is skipped.
        self.uids: UidPool | None = None
        if config.sandbox_uid is not None:
            pool_end = config.sandbox_uid + config.sandbox_uids
            self.uids = UidPool(config.sandbox_uid, config.sandbox_uids, self.helper.path, running_uids(config.sandbox_uid, pool_end))
        # 0711 root down to sbx/, then 0710 root:<its gid> for each sandbox's own dir: bwrap, running as the sandbox's uid,
        # must resolve its root's path (the paths are in the host's mountinfo, so hiding names would not help), nobody but
        # root may list, and no other host user, another sandbox's uid included, may pass into a sandbox's dir; the layer
        # store (layers.py) is 0700, reachable by the overlays (mounted by root) and by nothing else.
        sbx = os.path.join(self.state, "sbx")
        os.mkdir(sbx)
        os.chmod(sbx, 0o700 if config.sandbox_uid is None else 0o711)
        self.store = LayerStore(os.path.join(self.state, "layers"))
        self._lock = threading.Lock()
        self._boxes: dict[str, Instance] = {}
        self._meta: dict[str, _Meta] = {}
        self._snapshots: dict[str, SnapshotInfo] = {}
        self.standbys = Standbys(self._release, max_ready=config.max_standbys)
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
        labels: dict[str, str] | None = None,
    ) -> str:
        """A new sandbox over the base rootfs (image=None) or over an fs snapshot's layers (image=snapshot id); `labels` are
        the caller's, returned and matched by `list_sandboxes`."""
        if self._closed:
            raise Conflict("backend is closed")
        limits = limits or Limits()
        helper.environment(dict(env or {}), "env")
        if "\0" in workdir:
            raise InvalidArgument(f"workdir={workdir!r}: expected a path without NUL bytes")
        layers: tuple[str, ...] = ()
        if image is not None:
            snap = self.snapshot_info(image)
            if snap.kind is not SnapshotKind.FS:
                raise InvalidArgument(f"image={image!r}: a {snap.kind.value} snapshot cannot seed a namespace sandbox")
            layers = snap.layers
        sid = self._new_id("sb-")
        ttl = self.config.default_ttl_s if ttl_s is None else ttl_s
        now = time.time()
        meta = _Meta(limits, dict(env or {}), workdir, tuple(services), now + ttl, ttl, check_labels(labels or {}), image, now)
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
        uid: int | None = None
        try:
            uid, idmap = self.uids.take() if self.uids is not None else (None, None)
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
                self.helper,
                uid,
                idmap,
                self.config.sandbox_ptys,
                self.config.init_timeout_s,
            )
            box.start_init()
            return box
        except BaseException:
            try:
                if box is not None:
                    box.teardown()
                elif cg is not None:
                    cg.remove()
                self._give_back_uid(uid)
            finally:
                self.store.decref(layers)
            raise

    def _give_back_uid(self, uid: int | None) -> None:
        if self.uids is not None and uid is not None:
            self.uids.release(uid)

    def _release(self, box: Instance) -> None:
        """Tear `box` down and give back its layers, and its uid once its processes are gone (teardown raises otherwise)."""
        try:
            box.teardown()
            self._give_back_uid(box.uid)
        finally:
            self.store.decref(box.layers)

    def _params(self, meta: _Meta) -> tuple:
        return (meta.limits, tuple(sorted(meta.env.items())), meta.workdir)

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
        stdin: bytes | int | None = None,
        max_output_bytes: int = 1 << 20,
        stdout_fd: int | None = None,
        on_output: OnOutput | None = None,
        stop: threading.Event | None = None,
        on_start: Callable[[int], None] | None = None,
    ) -> ExecResult:
        """Run `cmd` in the sandbox; `stdin` as an int and `stdout_fd` are descriptors it reads or writes directly (archives);
        `on_output` takes the output as it comes (then not in the result), `stop` ends the command early and `on_start` gets
        the helper's pid when it starts (proc.py)."""
        box = self.check_exec(sid, cmd, timeout_s, cwd, env, max_output_bytes)
        return box.exec(cmd, timeout_s, cwd, dict(env or {}), stdin, max_output_bytes, stdout_fd=stdout_fd, on_output=on_output, stop=stop, on_start=on_start)

    def check_exec(self, sid: str, cmd: str | list[str], timeout_s: float, cwd: str | None, env: dict[str, str] | None, max_output_bytes: int) -> Instance:
        """The sandbox an exec with these arguments would run in, or the error it would raise before starting (so a stream or
        a background process can refuse with a 4xx before it answers)."""
        if not 0 < timeout_s <= 86400:
            raise InvalidArgument(f"timeout_s={timeout_s}: expected 0 < timeout_s <= 86400")
        if max_output_bytes < 0:
            raise InvalidArgument(f"max_output_bytes={max_output_bytes}: expected >= 0")
        if isinstance(cmd, list) and not cmd:
            raise InvalidArgument("cmd=[]: expected a shell string or a non-empty argv list")
        if any("\0" in part for part in ([cmd] if isinstance(cmd, str) else cmd)) or (cwd is not None and "\0" in cwd):
            raise InvalidArgument("cmd, cwd: expected strings without NUL bytes")
        helper.environment(dict(env or {}), "env")
        return self.box(sid)

    def destroy(self, sid: str) -> None:
        with self._lock:
            box = self._boxes.pop(sid, None)
            meta = self._meta.pop(sid, None)
        if box is None or meta is None:
            raise NotFound(f"sandbox_id={sid!r}: no such sandbox on host {self.config.host}")
        try:
            self._release(box)
        finally:
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

    def list_sandboxes(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        """Every sandbox whose labels include all of `labels` (all sandboxes without it), oldest first."""
        want = check_labels(labels or {})
        with self._lock:
            metas = list(self._meta.items())
        found = [
            SandboxInfo(sandbox_id=sid, labels=dict(m.labels), image=m.image, created_at=m.created_at, expires_at=m.expires_at)
            for sid, m in metas
            if all(m.labels.get(k) == v for k, v in want.items())
        ]
        return sorted(found, key=lambda i: (i.created_at, i.sandbox_id))

    def sandboxes(self) -> list[str]:
        with self._lock:
            return sorted(self._boxes)

    def merged_root(self, sid: str) -> str:
        return self.box(sid).merged
