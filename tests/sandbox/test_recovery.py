"""A daemon that dies without cleaning up: the next one on the same state dir removes its processes, mounts and cgroups."""

from __future__ import annotations

import dataclasses
import os
import tempfile

import pytest

from openk3.sandbox.linux import syscalls
from openk3.sandbox.linux.cgroups import pids_under
from openk3.sandbox.namespace.backend import NamespaceBackend
from openk3.sandbox.namespace.settings import BackendConfig

pytestmark = pytest.mark.sandbox


def test_restart_recovers_crashed_daemon_state(service):
    state = tempfile.mkdtemp(prefix="openk3-sandbox-crash-", dir="/tmp")
    config = BackendConfig(state_dir=state, cache_dir=service.backend.config.cache_dir, store_bytes=256 * 2**20, sandbox_uid=service.backend.config.sandbox_uid)
    # prewarm off: a live background thread of the "crashed" daemon would keep building after the recovery ran
    crashed = NamespaceBackend(dataclasses.replace(config, prewarm=False))
    sid = crashed.create()
    crashed.exec(sid, "setsid sleep 300 >/dev/null 2>&1 &")
    crashed.snapshot(sid)
    control = os.path.join(crashed.layout.control_root or "", crashed.cg_prefix)
    assert pids_under(control) and syscalls.mounts_under(crashed.state)
    # No close(): the process "crashed". A new daemon on the same state dir must clean up before it starts.
    fresh = NamespaceBackend(config)
    try:
        assert fresh.sandboxes() == []
        assert pids_under(control) == []
        assert syscalls.mounts_under(os.path.join(fresh.state, "sbx")) == []
        sid2 = fresh.create()
        assert fresh.exec(sid2, "echo ok").stdout == b"ok\n"
        fresh.destroy(sid2)
    finally:
        fresh.close()
        init = crashed.box(sid).init
        assert init is not None
        init.wait()  # reap the killed init the crashed object still holds
    assert syscalls.mounts_under(state) == []
    assert not os.path.exists(control)
