"""Which tenant owns which sandbox, environment and snapshot, and what each holds against its quotas.

Owners are recorded when an object is handed out (create, fork, create_env, snapshot, import) and dropped when it is deleted.
Sandboxes can also go without a call (the TTL reaper): the live count is taken against the service's own tables (`live`),
so a reaped sandbox stops counting at once and its stale entry is pruned. A create reserves its slots before it starts, so
concurrent creates cannot together pass the quota.

Store bytes: `charge(tenant)` is the callable the backend calls with the running total of new bytes a snapshot or import is
about to write; it raises QuotaExceeded past the tenant's remaining bytes. `settle` records what the snapshot really added.

Contract: one lock guards every table here; nothing else is called under it.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator

from openk3.sandbox.api.tenants import Tenant, Tenants
from openk3.sandbox.protocol import QuotaExceeded

SANDBOX_PREFIXES = ("sb-", "pe-")  # what max_sandboxes counts


class TenantLedger:
    def __init__(self, tenants: Tenants, live: Callable[[], set[str]]) -> None:
        self.tenants = tenants
        self._live = live
        self._lock = threading.Lock()
        self._owner: dict[str, str] = {}
        self._stored: dict[str, int] = {}  # snapshot id -> store bytes charged for it
        self._pending = collections.Counter[str]()  # sandbox slots reserved by creates in flight
        self._refusals: dict[str, collections.Counter[str]] = {name: collections.Counter() for name in tenants.by_name}

    def owns(self, tenant: Tenant, object_id: str) -> bool:
        with self._lock:
            return self._owner.get(object_id) == tenant.name

    def owned(self, tenant: Tenant, prefixes: tuple[str, ...]) -> set[str]:
        with self._lock:
            return {i for i, name in self._owner.items() if name == tenant.name and i.startswith(prefixes)}

    def adopt(self, tenant: Tenant, *object_ids: str) -> None:
        with self._lock:
            for object_id in object_ids:
                self._owner[object_id] = tenant.name

    def forget(self, object_id: str) -> None:
        with self._lock:
            self._owner.pop(object_id, None)
            self._stored.pop(object_id, None)

    def _live_sandboxes(self, tenant: Tenant, live: set[str]) -> int:
        """The tenant's sandboxes still alive; entries of reaped ones are pruned. The lock is held."""
        gone = [i for i, name in self._owner.items() if name == tenant.name and i.startswith(SANDBOX_PREFIXES) and i not in live]
        for object_id in gone:
            del self._owner[object_id]
        return sum(name == tenant.name and i.startswith(SANDBOX_PREFIXES) for i, name in self._owner.items())

    def _refuse(self, tenant: Tenant, quota: str, message: str) -> QuotaExceeded:
        self._refusals[tenant.name][quota] += 1
        return QuotaExceeded(message)

    @contextlib.contextmanager
    def reserve_sandboxes(self, tenant: Tenant, n: int) -> Iterator[None]:
        """Hold `n` of the tenant's sandbox slots while they are being made (adopt them before leaving)."""
        live = self._live()
        with self._lock:
            held = self._live_sandboxes(tenant, live) + self._pending[tenant.name]
            if tenant.max_sandboxes is not None and held + n > tenant.max_sandboxes:
                raise self._refuse(
                    tenant, "sandboxes", f"tenant {tenant.name}: {held} sandboxes live and {n} more would pass max_sandboxes={tenant.max_sandboxes}"
                )
            self._pending[tenant.name] += n
        try:
            yield
        finally:
            with self._lock:
                self._pending[tenant.name] -= n

    def store_bytes(self, tenant: Tenant) -> int:
        with self._lock:
            return sum(n for i, n in self._stored.items() if self._owner.get(i) == tenant.name)

    def charge(self, tenant: Tenant) -> Callable[[int], None]:
        """The backend's `charge` for one snapshot or import of this tenant: refuses a running total of new bytes past what
        the tenant has left."""

        def charge(total: int) -> None:
            if tenant.max_store_bytes is None:
                return
            used = self.store_bytes(tenant)
            if used + total > tenant.max_store_bytes:
                with self._lock:
                    raise self._refuse(
                        tenant,
                        "store_bytes",
                        f"tenant {tenant.name}: its snapshots hold {used} bytes of the layer store and this one needs {total} more, "
                        f"over max_store_bytes={tenant.max_store_bytes} (delete some snapshots)",
                    )

        return charge

    def settle(self, tenant: Tenant, snapshot_id: str, stored_bytes: int) -> None:
        """The snapshot is the tenant's, holding `stored_bytes` of its store quota."""
        with self._lock:
            self._owner[snapshot_id] = tenant.name
            self._stored[snapshot_id] = stored_bytes

    def figures(self) -> dict[str, tuple[int, int, dict[str, int]]]:
        """Per tenant: (live sandboxes, store bytes, refusals by quota), for /metrics."""
        live = self._live()
        out = {}
        for tenant in self.tenants.by_name.values():
            with self._lock:
                count = self._live_sandboxes(tenant, live)
                refused = dict(self._refusals[tenant.name])
            out[tenant.name] = (count, self.store_bytes(tenant), refused)
        return out
