"""`GET /metrics` of the sandbox daemon: its state in the Prometheus text format, read from the service at scrape time.

Nothing is counted twice: gauges are read from the tables that hold the objects (sandboxes, environments, snapshots,
background handles, the output budget, the state tmpfs) when a scrape comes, so they cannot drift from them; the only
counters are the ones their owners keep (bytes the output budget dropped, quota refusals per tenant). One registry per app,
no module state. The route is behind the API key like every other and daemon-wide, so only the operator's tenant may read
it (server.py): the figures cover every tenant.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from openk3.sandbox.api.service import SandboxService
from openk3.sandbox.protocol import SnapshotKind

CONTENT_TYPE = CONTENT_TYPE_LATEST
P = "openk3_sandbox_"

# Per-tenant figures (tenant_view.py fills them): name -> (live sandboxes, store bytes, {quota: refusals}).
TenantFigures = Callable[[], dict[str, tuple[int, int, dict[str, int]]]]


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(P + name, doc, value=value)


class _Collector:
    def __init__(self, service: SandboxService, tenants: TenantFigures | None) -> None:
        self.service = service
        self.tenants = tenants

    def collect(self) -> Iterator[Metric]:
        svc = self.service
        yield _gauge("sandboxes", "Live namespace sandboxes.", len(svc.backend.sandboxes()))
        yield _gauge("environments", "Live Python environments (pe-).", sum(i.startswith("pe-") for i in svc.envs.ids()))
        snapshots = GaugeMetricFamily(P + "snapshots", "Live snapshots by kind.", labels=["kind"])
        snapshots.add_metric([SnapshotKind.FS.value], len(svc.backend.snapshots()))
        snapshots.add_metric([SnapshotKind.PROCESS.value], sum(i.startswith("psnap-") for i in svc.envs.ids()))
        yield snapshots
        st = os.statvfs(svc.backend.state)
        yield _gauge("store_size_bytes", "Size of the state tmpfs (layers, snapshot manifests, scratch).", st.f_blocks * st.f_frsize)
        yield _gauge("store_used_bytes", "Bytes used on the state tmpfs.", (st.f_blocks - st.f_bfree) * st.f_frsize)
        background = svc.background
        running = background.running_count()
        handles = GaugeMetricFamily(P + "background_processes", "Background process handles by state.", labels=["state"])
        handles.add_metric(["running"], running)
        handles.add_metric(["finished"], len(background.ids()) - running)
        yield handles
        budget = background.budget
        yield _gauge("output_budget_bytes", "Background output the daemon keeps at most, all processes together.", budget.limit_bytes)
        yield _gauge("output_buffered_bytes", "Background output kept now, waiting to be fetched.", budget.buffered_bytes)
        yield CounterMetricFamily(P + "output_dropped_bytes", "Background output dropped (oldest first) to stay within the budget.", value=budget.dropped_bytes)
        if self.tenants is not None:
            yield from _tenant_metrics(self.tenants())


def _tenant_metrics(figures: dict[str, tuple[int, int, dict[str, int]]]) -> Iterator[Metric]:
    sandboxes = GaugeMetricFamily(P + "tenant_sandboxes", "Live sandboxes and environments per tenant.", labels=["tenant"])
    store = GaugeMetricFamily(P + "tenant_store_bytes", "Store bytes charged to each tenant's live snapshots.", labels=["tenant"])
    refusals = CounterMetricFamily(P + "tenant_quota_refusals", "Calls refused by a tenant quota.", labels=["tenant", "quota"])
    for name, (live, stored, refused) in sorted(figures.items()):
        sandboxes.add_metric([name], live)
        store.add_metric([name], stored)
        for quota, n in sorted(refused.items()):
            refusals.add_metric([name, quota], n)
    yield from (sandboxes, store, refusals)


def registry(service: SandboxService, tenants: TenantFigures | None = None) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(service, tenants))  # type: ignore[arg-type]
    return reg


def render(reg: CollectorRegistry) -> bytes:
    return generate_latest(reg)
