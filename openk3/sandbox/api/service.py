"""SandboxService: the whole sandbox API of one host, the object the HTTP server exposes and tests drive directly.

It routes by id prefix: "sb-" namespace sandboxes and "snap-" fs snapshots go to NamespaceBackend, "pe-" Python environments
and "psnap-" process snapshots to ProcessEnvs. Files, tar transfer, shell sessions and snapshot export/import are built here
on top of the backend's primitives.
"""

from __future__ import annotations

import io
import threading
import uuid
from collections.abc import Iterator

from openk3.sandbox.api import transfer
from openk3.sandbox.api.background import BackgroundProcesses
from openk3.sandbox.api.output_budget import DEFAULT_OUTPUT_BUDGET
from openk3.sandbox.api.service_interactive import InteractiveCalls
from openk3.sandbox.api.terminals import Terminals
from openk3.sandbox.api.watches import Watches
from openk3.sandbox.fs import archive, safefs
from openk3.sandbox.linux.proc import OnOutput
from openk3.sandbox.namespace.backend import Charge, NamespaceBackend
from openk3.sandbox.namespace.settings import BackendConfig
from openk3.sandbox.namespace.shell import ShellSession
from openk3.sandbox.process.envs import ProcessEnvs
from openk3.sandbox.process.registry import EnvFactories
from openk3.sandbox.protocol import (
    ArchiveLimits,
    DirEntry,
    ExecResult,
    InvalidArgument,
    Limits,
    NotFound,
    ProcessOutput,
    ProcessStatus,
    SandboxError,
    SandboxInfo,
    SandboxStats,
    SnapshotInfo,
    SnapshotKind,
)


class SandboxService(InteractiveCalls):
    def __init__(self, config: BackendConfig | None = None, factories: EnvFactories | None = None, output_budget_bytes: int = DEFAULT_OUTPUT_BUDGET) -> None:
        self.backend = NamespaceBackend(config)
        self.envs = ProcessEnvs(self.backend.layout, self.backend.cg_prefix, self.backend.config.host, self.backend.helper, factories)
        self._lock = threading.Lock()
        self._shells: dict[str, tuple[str, ShellSession]] = {}
        self.background = BackgroundProcesses(self.backend, output_budget_bytes=output_budget_bytes)
        self.terminals = Terminals(self.backend)
        self.watches = Watches(self.backend)

    # namespace sandboxes
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
        return self.backend.create(image, limits, env, workdir, ttl_s, services, labels)

    def list_sandboxes(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        """Namespace sandboxes whose labels include every given one (all of them without `labels`)."""
        return self.backend.list_sandboxes(labels)

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

    def check_exec(self, sandbox_id: str, cmd: str | list[str], timeout_s: float, cwd: str | None, env: dict[str, str] | None, max_output_bytes: int) -> None:
        """Raise what an exec with these arguments would raise before starting (so a stream can still answer 4xx)."""
        self.backend.check_exec(sandbox_id, cmd, timeout_s, cwd, env, max_output_bytes)

    def exec_streaming(
        self,
        sandbox_id: str,
        cmd: str | list[str],
        on_output: OnOutput,
        stop: threading.Event,
        timeout_s: float = 60.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: bytes | None = None,
        max_output_bytes: int = 1 << 20,
    ) -> ExecResult:
        """exec with its output handed to `on_output` as it arrives (the result's stdout and stderr stay empty); `stop` kills
        it (the HTTP server sets it when the client goes away)."""
        return self.backend.exec(sandbox_id, cmd, timeout_s, cwd, env, stdin, max_output_bytes, on_output=on_output, stop=stop)

    # background processes (background.py)
    def spawn(
        self,
        sandbox_id: str,
        cmd: str | list[str],
        timeout_s: float = 3600.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        max_output_bytes: int = 16 << 20,
        stdin: bool = False,
    ) -> str:
        return self.background.spawn(sandbox_id, cmd, timeout_s, cwd, env, max_output_bytes, stdin)

    def process_status(self, process_id: str) -> ProcessStatus:
        return self.background.status(process_id)

    def process_output(self, process_id: str, stdout_offset: int = 0, stderr_offset: int = 0, max_bytes: int = 1 << 20) -> ProcessOutput:
        return self.background.output(process_id, stdout_offset, stderr_offset, max_bytes)

    def process_wait(self, process_id: str, timeout_s: float = 60.0) -> ProcessStatus:
        return self.background.wait(process_id, timeout_s)

    def process_kill(self, process_id: str) -> ProcessStatus:
        return self.background.kill(process_id)

    def read_file(self, sandbox_id: str, path: str, max_bytes: int = 64 << 20) -> bytes:
        return safefs.read_file(self.backend.merged_root(sandbox_id), path, max_bytes)

    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        box = self.backend.box(sandbox_id)  # its own uid: a file the host writes is the sandbox's root's, as if it wrote it
        safefs.write_file(box.merged, path, data, mode, box.uid)

    def list_dir(self, sandbox_id: str, path: str = "/") -> list[DirEntry]:
        return safefs.list_dir(self.backend.merged_root(sandbox_id), path)

    def _archive_limits(self, limits: ArchiveLimits | None) -> ArchiveLimits:
        return (limits or ArchiveLimits()).within(self.backend.config.archive_limits)

    def upload_tar(self, sandbox_id: str, data: bytes | archive.Reader, dest: str = "/", limits: ArchiveLimits | None = None) -> None:
        """Unpack a tar (optionally zstd-compressed) at `dest`, streamed from `data` within `limits`; the sandbox's own tar
        does it, so paths stay inside."""
        source = io.BytesIO(data) if isinstance(data, bytes) else data
        transfer.upload_tar(self.backend, sandbox_id, source, dest, self._archive_limits(limits))

    def download_tar_stream(self, sandbox_id: str, path: str, limits: ArchiveLimits | None = None) -> Iterator[bytes]:
        """The tar of `path` as chunks (what the HTTP server sends); errors come while iterating."""
        return transfer.download_tar(self.backend, sandbox_id, path, self._archive_limits(limits))

    def download_tar(self, sandbox_id: str, path: str, limits: ArchiveLimits | None = None) -> bytes:
        return b"".join(self.download_tar_stream(sandbox_id, path, limits))

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

    def shell_sandbox(self, shell_id: str) -> str | None:
        """The sandbox a shell session runs in, None when there is no such session."""
        with self._lock:
            entry = self._shells.get(shell_id)
        return None if entry is None else entry[0]

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
        return self.snapshot_charged(source_id, kind, None)

    # The *_charged forms take the store charge of a multi-tenant front end (tenant_view.py): called with the running total
    # of bytes the store would newly hold, before they are written, it raises QuotaExceeded to refuse. They are no routes
    # (the server routes the names in server.METHODS only), so no caller can pass a charge over HTTP.
    def snapshot_charged(self, source_id: str, kind: SnapshotKind | str, charge: Charge | None) -> SnapshotInfo:
        kind = SnapshotKind(kind)
        if source_id.startswith("pe-"):
            if kind is not SnapshotKind.PROCESS:
                raise InvalidArgument(f"kind={kind.value!r}: a Python environment ({source_id}) takes kind='process'")
            return self.envs.snapshot(source_id)
        if kind is not SnapshotKind.FS:
            raise InvalidArgument(f"kind={kind.value!r}: namespace sandboxes take kind='fs' (no CRIU: see docs/sandbox.md)")
        return self.backend.snapshot(source_id, charge=charge)

    def restore(self, target_id: str, snapshot_id: str) -> None:
        if target_id.startswith("pe-"):
            self.envs.restore(target_id, snapshot_id)
            return
        self._close_shells_of(target_id)
        self.background.stop_sandbox(target_id)
        self._end_interactive(target_id, forget=False)
        self.backend.restore(target_id, snapshot_id)

    def fork(self, source_id: str, n: int) -> list[str]:
        return self.fork_charged(source_id, n, None)

    def fork_charged(self, source_id: str, n: int, charge: Charge | None) -> list[str]:
        if source_id.startswith(("pe-", "psnap-")):
            return self.envs.fork(source_id, n)
        return self.backend.fork(source_id, n, charge=charge)

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
        self.background.forget_sandbox(target_id)
        self._end_interactive(target_id, forget=True)
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
            self.background.forget_sandbox(sid)
            self._end_interactive(sid, forget=True)
            try:
                self.backend.destroy(sid)
                reaped.append(sid)
            except NotFound:
                continue
        return reaped

    # transport: snapshots travel as tar.zst of a manifest plus the layers the receiver lacks, addressed by digest
    def export_snapshot_stream(self, snapshot_id: str, skip_layers: tuple[str, ...] = ()) -> Iterator[bytes]:
        return transfer.export_snapshot(self.backend, snapshot_id, tuple(skip_layers))

    def export_snapshot(self, snapshot_id: str, skip_layers: tuple[str, ...] = ()) -> bytes:
        return b"".join(self.export_snapshot_stream(snapshot_id, skip_layers))

    def import_snapshot(self, data: bytes | archive.Reader, limits: ArchiveLimits | None = None) -> SnapshotInfo:
        """Verify every shipped layer against its digest, reuse layers already here, and register a new snapshot."""
        return self.import_snapshot_charged(data, limits, None)

    def import_snapshot_charged(self, data: bytes | archive.Reader, limits: ArchiveLimits | None, charge: Charge | None) -> SnapshotInfo:
        source = io.BytesIO(data) if isinstance(data, bytes) else data
        return transfer.import_snapshot(self.backend, source, self._archive_limits(limits), charge=charge)

    def close(self, keep_snapshots: bool = False) -> None:
        """Everything this service holds goes; fs snapshots stay on the state dir for the next daemon if `keep_snapshots`."""
        with self._lock:
            shells = list(self._shells)
        for shell_id in shells:
            try:
                self.close_shell(shell_id)
            except SandboxError:
                continue
        self.background.close()
        self.terminals.table.close()
        self.watches.table.close()
        self.envs.close()
        self.backend.close(keep_snapshots)
