"""The interactive calls (service_interactive.py) as one tenant sees them (tenant_view.py): a terminal or a watch is its
sandbox's, so it is the tenant's exactly when that sandbox is; any other id is refused as one that never existed."""

from __future__ import annotations

from collections.abc import Iterator

from openk3.sandbox.api.service import SandboxService
from openk3.sandbox.api.service_interactive import SignalArg
from openk3.sandbox.api.tenant_ledger import TenantLedger
from openk3.sandbox.api.tenants import Tenant
from openk3.sandbox.protocol import NotFound
from openk3.sandbox.protocol_interactive import PtyOutput, PtyStatus, WatchEvent, WatchEvents


class TenantInteractive:
    service: SandboxService
    tenant: Tenant
    ledger: TenantLedger

    def _own(self, field: str, object_id: str) -> str:
        raise NotImplementedError  # TenantView's

    def _own_process(self, process_id: str) -> str:
        raise NotImplementedError  # TenantView's

    def _own_pty(self, pty_id: str) -> str:
        try:
            sandbox_id: str | None = self.service.terminals.table.get(pty_id).sandbox_id
        except NotFound:
            sandbox_id = None
        if sandbox_id is None or not self.ledger.owns(self.tenant, sandbox_id):
            raise NotFound(f"pty_id={pty_id!r}: not found")
        return pty_id

    def _own_watch(self, watch_id: str) -> str:
        try:
            sandbox_id: str | None = self.service.watches.table.get(watch_id).sandbox_id
        except NotFound:
            sandbox_id = None
        if sandbox_id is None or not self.ledger.owns(self.tenant, sandbox_id):
            raise NotFound(f"watch_id={watch_id!r}: not found")
        return watch_id

    def process_write_stdin(self, process_id: str, data: bytes, timeout_s: float = 10.0) -> int:
        return self.service.process_write_stdin(self._own_process(process_id), data, timeout_s)

    def process_close_stdin(self, process_id: str) -> None:
        self.service.process_close_stdin(self._own_process(process_id))

    def process_signal(self, process_id: str, signal: SignalArg) -> None:
        self.service.process_signal(self._own_process(process_id), signal)

    def pty_create(
        self,
        sandbox_id: str,
        cmd: str | list[str] | None = None,
        rows: int = 24,
        cols: int = 80,
        timeout_s: float = 3600.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        max_buffer_bytes: int = 1 << 20,
    ) -> str:
        return self.service.pty_create(self._own("sandbox_id", sandbox_id), cmd, rows, cols, timeout_s, cwd, env, max_buffer_bytes)

    def pty_write(self, pty_id: str, data: bytes, timeout_s: float = 10.0) -> int:
        return self.service.pty_write(self._own_pty(pty_id), data, timeout_s)

    def pty_resize(self, pty_id: str, rows: int, cols: int) -> None:
        self.service.pty_resize(self._own_pty(pty_id), rows, cols)

    def pty_read(self, pty_id: str, offset: int = 0, max_bytes: int = 1 << 20, timeout_s: float = 0.0) -> PtyOutput:
        return self.service.pty_read(self._own_pty(pty_id), offset, max_bytes, timeout_s)

    def pty_stream(self, pty_id: str, offset: int = 0, max_bytes: int = 1 << 16) -> Iterator[PtyOutput | None]:
        return self.service.pty_stream(self._own_pty(pty_id), offset, max_bytes)

    def pty_status(self, pty_id: str) -> PtyStatus:
        return self.service.pty_status(self._own_pty(pty_id))

    def pty_wait(self, pty_id: str, timeout_s: float = 60.0) -> PtyStatus:
        return self.service.pty_wait(self._own_pty(pty_id), timeout_s)

    def pty_kill(self, pty_id: str) -> PtyStatus:
        return self.service.pty_kill(self._own_pty(pty_id))

    def watch_dir(self, sandbox_id: str, path: str, recursive: bool = True, max_events: int = 4096, max_dirs: int = 1024) -> str:
        return self.service.watch_dir(self._own("sandbox_id", sandbox_id), path, recursive, max_events, max_dirs)

    def watch_events(self, watch_id: str, timeout_s: float = 0.0, max_events: int = 4096) -> WatchEvents:
        return self.service.watch_events(self._own_watch(watch_id), timeout_s, max_events)

    def watch_stream(self, watch_id: str) -> Iterator[WatchEvent | None]:
        return self.service.watch_stream(self._own_watch(watch_id))

    def watch_stop(self, watch_id: str) -> None:
        self.service.watch_stop(self._own_watch(watch_id))
