"""TenantView: the sandbox API as one tenant sees it, the object the HTTP server calls for a request carrying that tenant's key.

It has the service's method names and signatures, and each checks, before the service runs, that every id the call names
is the tenant's (tenant_ledger.py). An id that is not (another tenant's, or none at all) is refused with the same 404 and
the same message whichever it is, so a refusal reveals nothing about other tenants; lists show the tenant's own objects
only. Background processes and shell sessions belong to whoever owns their sandbox. A service method this class does not
define has no route for tenants: the server looks every route up here and fails to start on a missing one.

Store quota: each snapshot, fork of a live sandbox (its transient snapshot) and import passes the tenant's charge to the
backend (SandboxService's *_charged forms), which calls it with the bytes the store would newly hold before writing any, so
a snapshot past the tenant's `max_store_bytes` is refused with nothing written; what it did add (`stored_bytes`) is then
the tenant's. Two snapshots of one tenant that run at once are each checked against what was settled before them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from openk3.sandbox.api.service import SandboxService
from openk3.sandbox.api.tenant_ledger import TenantLedger
from openk3.sandbox.api.tenant_view_interactive import TenantInteractive
from openk3.sandbox.api.tenants import Tenant
from openk3.sandbox.fs import archive
from openk3.sandbox.linux.proc import OnOutput
from openk3.sandbox.namespace.backend import Charge
from openk3.sandbox.protocol import (
    ArchiveLimits,
    DirEntry,
    ExecResult,
    Limits,
    NotFound,
    ProcessOutput,
    ProcessStatus,
    SandboxInfo,
    SandboxStats,
    SnapshotInfo,
    SnapshotKind,
)


class TenantView(TenantInteractive):
    def __init__(self, service: SandboxService, tenant: Tenant, ledger: TenantLedger) -> None:
        self.service = service
        self.tenant = tenant
        self.ledger = ledger

    def _own(self, field: str, object_id: str) -> str:
        if not self.ledger.owns(self.tenant, object_id):
            raise NotFound(f"{field}={object_id!r}: not found")
        return object_id

    def _own_process(self, process_id: str) -> str:
        try:
            sandbox_id = self.service.background.sandbox_of(process_id)
        except NotFound:
            sandbox_id = None
        if sandbox_id is None or not self.ledger.owns(self.tenant, sandbox_id):
            raise NotFound(f"process_id={process_id!r}: not found")
        return process_id

    def _own_shell(self, shell_id: str) -> str:
        sandbox_id = self.service.shell_sandbox(shell_id)
        if sandbox_id is None or not self.ledger.owns(self.tenant, sandbox_id):
            raise NotFound(f"shell_id={shell_id!r}: not found")
        return shell_id

    def _snapshotted(self, make: Callable[[Charge], SnapshotInfo]) -> SnapshotInfo:
        """Run a snapshot or import under the tenant's store charge, and record it as the tenant's with what it added."""
        info = make(self.ledger.charge(self.tenant))
        self.ledger.settle(self.tenant, info.snapshot_id, info.stored_bytes)
        return info

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
        if image is not None:
            self._own("image", image)
        with self.ledger.reserve_sandboxes(self.tenant, 1):
            sid = self.service.create(image, limits, env, workdir, ttl_s, services, labels)
            self.ledger.adopt(self.tenant, sid)
        return sid

    def list_sandboxes(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        return [i for i in self.service.list_sandboxes(labels) if self.ledger.owns(self.tenant, i.sandbox_id)]

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
        return self.service.exec(self._own("sandbox_id", sandbox_id), cmd, timeout_s, cwd, env, stdin, max_output_bytes)

    def check_exec(self, sandbox_id: str, cmd: str | list[str], timeout_s: float, cwd: str | None, env: dict[str, str] | None, max_output_bytes: int) -> None:
        self.service.check_exec(self._own("sandbox_id", sandbox_id), cmd, timeout_s, cwd, env, max_output_bytes)

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
        return self.service.exec_streaming(self._own("sandbox_id", sandbox_id), cmd, on_output, stop, timeout_s, cwd, env, stdin, max_output_bytes)

    # background processes
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
        return self.service.spawn(self._own("sandbox_id", sandbox_id), cmd, timeout_s, cwd, env, max_output_bytes, stdin)

    def process_status(self, process_id: str) -> ProcessStatus:
        return self.service.process_status(self._own_process(process_id))

    def process_output(self, process_id: str, stdout_offset: int = 0, stderr_offset: int = 0, max_bytes: int = 1 << 20) -> ProcessOutput:
        return self.service.process_output(self._own_process(process_id), stdout_offset, stderr_offset, max_bytes)

    def process_wait(self, process_id: str, timeout_s: float = 60.0) -> ProcessStatus:
        return self.service.process_wait(self._own_process(process_id), timeout_s)

    def process_kill(self, process_id: str) -> ProcessStatus:
        return self.service.process_kill(self._own_process(process_id))

    # files and archives
    def read_file(self, sandbox_id: str, path: str, max_bytes: int = 64 << 20) -> bytes:
        return self.service.read_file(self._own("sandbox_id", sandbox_id), path, max_bytes)

    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        self.service.write_file(self._own("sandbox_id", sandbox_id), path, data, mode)

    def list_dir(self, sandbox_id: str, path: str = "/") -> list[DirEntry]:
        return self.service.list_dir(self._own("sandbox_id", sandbox_id), path)

    def upload_tar(self, sandbox_id: str, data: bytes | archive.Reader, dest: str = "/", limits: ArchiveLimits | None = None) -> None:
        self.service.upload_tar(self._own("sandbox_id", sandbox_id), data, dest, limits)

    def download_tar_stream(self, sandbox_id: str, path: str, limits: ArchiveLimits | None = None) -> Iterator[bytes]:
        return self.service.download_tar_stream(self._own("sandbox_id", sandbox_id), path, limits)

    # shell sessions
    def open_shell(self, sandbox_id: str, cwd: str | None = None, env: dict[str, str] | None = None) -> str:
        return self.service.open_shell(self._own("sandbox_id", sandbox_id), cwd, env)

    def shell_run(self, shell_id: str, cmd: str, timeout_s: float = 60.0, max_output_bytes: int = 1 << 20) -> ExecResult:
        return self.service.shell_run(self._own_shell(shell_id), cmd, timeout_s, max_output_bytes)

    def close_shell(self, shell_id: str) -> None:
        self.service.close_shell(self._own_shell(shell_id))

    # Python environments
    def create_env(self, factory: str, kwargs: dict | None = None, pythonpath: list[str] | None = None, memory_bytes: int | None = None) -> str:
        with self.ledger.reserve_sandboxes(self.tenant, 1):
            env_id = self.service.create_env(factory, kwargs, pythonpath, memory_bytes)
            self.ledger.adopt(self.tenant, env_id)
        return env_id

    def call_env(self, env_id: str, method: str, args: list | None = None, kwargs: dict | None = None):
        return self.service.call_env(self._own("env_id", env_id), method, args, kwargs)

    # snapshots, restore, fork, destroy
    def snapshot(self, source_id: str, kind: SnapshotKind | str = SnapshotKind.FS) -> SnapshotInfo:
        self._own("source_id", source_id)
        return self._snapshotted(lambda charge: self.service.snapshot_charged(source_id, kind, charge))

    def restore(self, target_id: str, snapshot_id: str) -> None:
        self.service.restore(self._own("target_id", target_id), self._own("snapshot_id", snapshot_id))

    def fork(self, source_id: str, n: int) -> list[str]:
        self._own("source_id", source_id)
        with self.ledger.reserve_sandboxes(self.tenant, n):
            children = self.service.fork_charged(source_id, n, self.ledger.charge(self.tenant))
            self.ledger.adopt(self.tenant, *children)
        return children

    def delete_snapshot(self, snapshot_id: str) -> None:
        self.service.delete_snapshot(self._own("snapshot_id", snapshot_id))
        self.ledger.forget(snapshot_id)

    def destroy(self, target_id: str) -> None:
        self.service.destroy(self._own("target_id", target_id))
        self.ledger.forget(target_id)

    def stats(self, sandbox_id: str) -> SandboxStats:
        return self.service.stats(self._own("sandbox_id", sandbox_id))

    def heartbeat(self, sandbox_id: str, ttl_s: float | None = None) -> float:
        return self.service.heartbeat(self._own("sandbox_id", sandbox_id), ttl_s)

    # transport
    def export_snapshot_stream(self, snapshot_id: str, skip_layers: tuple[str, ...] = ()) -> Iterator[bytes]:
        return self.service.export_snapshot_stream(self._own("snapshot_id", snapshot_id), skip_layers)

    def import_snapshot(self, data: bytes | archive.Reader, limits: ArchiveLimits | None = None) -> SnapshotInfo:
        return self._snapshotted(lambda charge: self.service.import_snapshot_charged(data, limits, charge))
