"""Shared fixtures for the sandbox suite: one host probe, one service per session, and a leak check after every test.

Tests marked `sandbox` skip as a whole, with the probe's reason, where the host lacks root, bwrap, overlayfs, user namespaces
or a way to freeze and kill cgroups; everything else must work here.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest

from openk3.sandbox.api.service import SandboxService
from openk3.sandbox.linux import syscalls
from openk3.sandbox.linux.cgroups import pids_under
from openk3.sandbox.linux.host import probe
from openk3.sandbox.namespace.settings import BackendConfig, check_unshared_id
from openk3.sandbox.protocol import InvalidArgument


@pytest.fixture(scope="session")
def host_features():
    features = probe()
    if features.unavailable_reason:
        pytest.skip(f"namespace sandboxes unavailable: {features.unavailable_reason}")
    return features


def started(config: BackendConfig) -> Iterator[SandboxService]:
    svc = SandboxService(config)
    yield svc
    svc.close()
    assert syscalls.mounts_under(svc.backend.state) == [], "mounts left after close"
    for root in cgroup_roots(svc):
        assert not os.path.exists(os.path.join(root, svc.backend.cg_prefix)), "cgroup subtree left after close"
    assert not os.path.exists(config.state_dir)


def state_dir() -> str:
    # Not under pytest's 0700 tmp tree: bwrap runs as the unprivileged sandbox uid and must traverse the state dir's parents.
    return tempfile.mkdtemp(prefix="openk3-sandbox-test-", dir="/tmp")


def sandbox_uid() -> int:
    """The default sandbox uid, or, where this host gives an id of its pool to someone (a subuid range), one far above the
    usual ranges."""
    for uid in (100_000, 1_900_000_000):
        try:
            check_unshared_id(uid, BackendConfig.sandbox_uids)
            return uid
        except InvalidArgument:
            continue
    pytest.skip("no free sandbox uids: 100000.. and 1900000000.. both meet a host user, group or subordinate id range")


@pytest.fixture(scope="session")
def service(host_features, tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("sandbox-cache"))
    yield from started(BackendConfig(state_dir=state_dir(), cache_dir=cache, store_bytes=2 * 2**30, sandbox_uid=sandbox_uid()))


@pytest.fixture(scope="session")
def root_service(service):
    """A second daemon whose sandboxes run as host root (sandbox_uid=None), for the checks that must hold either way."""
    yield from started(BackendConfig(state_dir=state_dir(), cache_dir=service.backend.config.cache_dir, store_bytes=512 * 2**20, sandbox_uid=None))


def cgroup_roots(svc: SandboxService) -> set[str]:
    layout = svc.backend.layout
    return {r for r in (layout.control_root, *layout.v1_roots.values()) if r}


def leftovers(svc: SandboxService) -> list[str]:
    """Everything a finished test could leak: sandboxes, environments, snapshots, layers, mounts, cgroups, processes."""
    found = []
    if svc.backend.sandboxes():
        found.append(f"sandboxes {svc.backend.sandboxes()}")
    if svc.envs.ids():
        found.append(f"process environments {svc.envs.ids()}")
    if svc.backend.snapshots():
        found.append(f"snapshots {[s.snapshot_id for s in svc.backend.snapshots()]}")
    if svc.backend.store.refcounts():
        found.append(f"layers {svc.backend.store.refcounts()}")
    svc.backend.store.check_integrity()
    if svc.backend.uids is not None:
        svc.backend.uids.check_integrity()
        if svc.backend.uids.held():
            found.append(f"host uids {svc.backend.uids.held()}")
    mounts = syscalls.mounts_under(os.path.join(svc.backend.state, "sbx"))
    if mounts:
        found.append(f"mounts {mounts}")
    for root in cgroup_roots(svc):
        prefix = os.path.join(root, svc.backend.cg_prefix)
        if os.path.isdir(prefix):
            subdirs = [d for d in os.listdir(prefix) if os.path.isdir(os.path.join(prefix, d))]
            if subdirs:
                found.append(f"cgroups under {prefix}: {subdirs}")
    control = os.path.join(svc.backend.layout.control_root or "", svc.backend.cg_prefix)
    if os.path.isdir(control) and pids_under(control):
        found.append(f"processes {pids_under(control)}")
    return found


def checked(service: SandboxService) -> Iterator[SandboxService]:
    """`service`, checked to be empty after the test (and cleaned so one leak does not fail every later test)."""
    yield service
    leaks = leftovers(service)
    for sid in service.backend.sandboxes():
        service.destroy(sid)
    for eid in service.envs.ids():
        service.envs.delete(eid)
    for snap in service.backend.snapshots():
        service.delete_snapshot(snap.snapshot_id)
    assert leaks == [], f"test left resources behind: {leaks}"


@pytest.fixture
def svc(service):
    yield from checked(service)


@pytest.fixture(params=["uid", "root"], ids=["sandbox_uid=100000", "sandbox_uid=None"])
def either_svc(request, service):
    """The session service and the host-root one in turn, for properties that must not depend on the sandbox uid."""
    yield from checked(service if request.param == "uid" else request.getfixturevalue("root_service"))
