"""SandboxService: the whole sandbox API of one host, the object the HTTP server exposes and tests drive directly.

It routes by id prefix: "sb-" namespace sandboxes and "snap-" fs snapshots go to NamespaceBackend, "pe-" Python environments
and "psnap-" process snapshots to ProcessEnvs. Files, tar transfer, shell sessions and snapshot export/import are built here
on top of the backend's primitives.
"""

from __future__ import annotations

import io
import json
import tarfile
import threading
import uuid

import zstandard

from openk3.sandbox.fs import safefs
from openk3.sandbox.namespace.backend import NamespaceBackend
from openk3.sandbox.namespace.settings import BackendConfig
from openk3.sandbox.namespace.shell import ShellSession
from openk3.sandbox.process.envs import ProcessEnvs
from openk3.sandbox.process.registry import EnvFactories
from openk3.sandbox.protocol import (
    DirEntry,
    ExecResult,
    InvalidArgument,
    Limits,
    NotFound,
    SandboxError,
    SandboxStats,
    SnapshotInfo,
    SnapshotKind,
)

MAX_TRANSFER_BYTES = 1 << 30


class SandboxService:
    def __init__(self, config: BackendConfig | None = None, factories: EnvFactories | None = None) -> None:
        self.backend = NamespaceBackend(config)
        self.envs = ProcessEnvs(self.backend.layout, self.backend.cg_prefix, self.backend.config.host, self.backend.helper, factories)
        self._lock = threading.Lock()
        self._shells: dict[str, tuple[str, ShellSession]] = {}

    # namespace sandboxes
    def create(
        self,
        image: str | None = None,
        limits: Limits | None = None,
        env: dict[str, str] | None = None,
        workdir: str = "/root",
        ttl_s: float | None = None,
        services: tuple[str, ...] = (),
    ) -> str:
        return self.backend.create(image, limits, env, workdir, ttl_s, services)

    def exec(
        self,
        sandbox_id: str,
        cmd: str | list[str],
        timeout_s: float = 60.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | None = None,
        max_output_bytes: int = 1 << 20,
    ) -> ExecResult:
        return self.backend.exec(sandbox_id, cmd, timeout_s, cwd, env, stdin, max_output_bytes)

    def read_file(self, sandbox_id: str, path: str, max_bytes: int = 64 << 20) -> bytes:
        return safefs.read_file(self.backend.merged_root(sandbox_id), path, max_bytes)

    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        safefs.write_file(self.backend.merged_root(sandbox_id), path, data, mode, self.backend.config.sandbox_uid)

    def list_dir(self, sandbox_id: str, path: str = "/") -> list[DirEntry]:
        return safefs.list_dir(self.backend.merged_root(sandbox_id), path)

    def upload_tar(self, sandbox_id: str, data: bytes, dest: str = "/") -> None:
        """Unpack a tar (optionally zstd-compressed) at `dest`; the sandbox's own tar does it, so paths stay inside."""
        if data[:4] == b"\x28\xb5\x2f\xfd":
            data = zstandard.ZstdDecompressor().decompressobj().decompress(data)
        r = self.exec(sandbox_id, ["tar", "-x", "--no-same-owner", "-f", "-", "-C", dest], stdin=data, timeout_s=300)
        if r.exit_code != 0:
            raise InvalidArgument(f"upload_tar to {dest!r} failed: {r.stderr.decode(errors='replace').strip()}")

    def download_tar(self, sandbox_id: str, path: str, max_bytes: int = MAX_TRANSFER_BYTES) -> bytes:
        r = self.exec(sandbox_id, ["tar", "-c", "-f", "-", "-C", path, "."], timeout_s=300, max_output_bytes=max_bytes)
        if r.exit_code != 0:
            raise InvalidArgument(f"download_tar of {path!r} failed: {r.stderr.decode(errors='replace').strip()}")
        if r.truncated:
            raise InvalidArgument(f"download_tar of {path!r}: archive exceeds max_bytes={max_bytes}")
        return r.stdout

    # shell sessions
    def open_shell(self, sandbox_id: str, cwd: str | None = None, env: dict[str, str] | None = None) -> str:
        session = ShellSession(self.backend.box(sandbox_id), cwd, dict(env or {}))
        shell_id = f"sh-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self._shells[shell_id] = (sandbox_id, session)
        return shell_id

    def _shell(self, shell_id: str) -> ShellSession:
        with self._lock:
            if shell_id not in self._shells:
                raise NotFound(f"shell_id={shell_id!r}: no such shell session")
            return self._shells[shell_id][1]

    def shell_run(self, shell_id: str, cmd: str, timeout_s: float = 60.0, max_output_bytes: int = 1 << 20) -> ExecResult:
        return self._shell(shell_id).run(cmd, timeout_s, max_output_bytes)

    def close_shell(self, shell_id: str) -> None:
        session = self._shell(shell_id)
        with self._lock:
            self._shells.pop(shell_id, None)
        session.close()

    def _close_shells_of(self, sandbox_id: str) -> None:
        with self._lock:
            doomed = [k for k, (sid, _) in self._shells.items() if sid == sandbox_id]
        for shell_id in doomed:
            self.close_shell(shell_id)

    # Python-native environments (process snapshots)
    def create_env(self, factory: str, kwargs: dict | None = None, pythonpath: list[str] | None = None, memory_bytes: int | None = None) -> str:
        """Start the registered environment factory `factory`; `pythonpath` is refused (the operator sets it, see registry.py)."""
        if pythonpath:
            raise InvalidArgument(
                f"pythonpath={pythonpath!r}: callers cannot extend the import path of host-side environments; "
                "the operator sets it with `openk3 sandbox serve --env-pythonpath DIR`"
            )
        return self.envs.create(factory, kwargs, memory_bytes)

    def call_env(self, env_id: str, method: str, args: list | None = None, kwargs: dict | None = None):
        return self.envs.call(env_id, method, args, kwargs)

    # routed by id
    def snapshot(self, source_id: str, kind: SnapshotKind | str = SnapshotKind.FS) -> SnapshotInfo:
        kind = SnapshotKind(kind)
        if source_id.startswith("pe-"):
            if kind is not SnapshotKind.PROCESS:
                raise InvalidArgument(f"kind={kind.value!r}: a Python environment ({source_id}) takes kind='process'")
            return self.envs.snapshot(source_id)
        if kind is not SnapshotKind.FS:
            raise InvalidArgument(f"kind={kind.value!r}: namespace sandboxes take kind='fs' (no CRIU: see docs/sandbox.md)")
        return self.backend.snapshot(source_id)

    def restore(self, target_id: str, snapshot_id: str) -> None:
        if target_id.startswith("pe-"):
            self.envs.restore(target_id, snapshot_id)
            return
        self._close_shells_of(target_id)
        self.backend.restore(target_id, snapshot_id)

    def fork(self, source_id: str, n: int) -> list[str]:
        if source_id.startswith(("pe-", "psnap-")):
            return self.envs.fork(source_id, n)
        return self.backend.fork(source_id, n)

    def delete_snapshot(self, snapshot_id: str) -> None:
        if snapshot_id.startswith("psnap-"):
            self.envs.delete(snapshot_id)
        else:
            self.backend.delete_snapshot(snapshot_id)

    def destroy(self, target_id: str) -> None:
        if target_id.startswith("pe-"):
            self.envs.delete(target_id)
            return
        self._close_shells_of(target_id)
        self.backend.destroy(target_id)

    def stats(self, sandbox_id: str) -> SandboxStats:
        return self.backend.stats(sandbox_id)

    def heartbeat(self, sandbox_id: str, ttl_s: float | None = None) -> float:
        return self.backend.heartbeat(sandbox_id, ttl_s)

    def reap_expired(self, now: float | None = None) -> list[str]:
        """Destroy every sandbox whose TTL passed without a heartbeat; returns their ids."""
        reaped = []
        for sid in self.backend.expired(now):
            self._close_shells_of(sid)
            try:
                self.backend.destroy(sid)
                reaped.append(sid)
            except NotFound:
                continue
        return reaped

    # transport: snapshots travel as tar.zst of a manifest plus the layers the receiver lacks, addressed by digest
    def export_snapshot(self, snapshot_id: str, skip_layers: tuple[str, ...] = ()) -> bytes:
        snap = self.backend.snapshot_info(snapshot_id)
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w") as tar:
            manifest = json.dumps({"layers": list(snap.layers), "captures": snap.captures}).encode()
            _add_bytes(tar, "manifest.json", manifest)
            for digest in snap.layers:
                if digest not in skip_layers:
                    _add_bytes(tar, f"layers/{digest}.tar.zst", self.backend.store.export(digest))
        return zstandard.ZstdCompressor(level=1).compress(raw.getvalue())

    def import_snapshot(self, data: bytes) -> SnapshotInfo:
        """Verify every shipped layer against its digest, reuse layers already here, and register a new snapshot."""
        try:
            raw = zstandard.ZstdDecompressor().decompressobj().decompress(data)
            with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
                files = {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}  # type: ignore[union-attr]
            digests = json.loads(files["manifest.json"])["layers"]
        except (zstandard.ZstdError, tarfile.TarError, KeyError, ValueError) as e:
            raise InvalidArgument(f"snapshot archive: not a tar.zst with a manifest.json ({e})") from e
        return self.backend.register_snapshot(digests, {d: files.get(f"layers/{d}.tar.zst") for d in digests})

    def close(self) -> None:
        with self._lock:
            shells = list(self._shells)
        for shell_id in shells:
            try:
                self.close_shell(shell_id)
            except SandboxError:
                continue
        self.envs.close()
        self.backend.close()


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
