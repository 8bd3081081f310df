"""The v1 code path (freezer freeze, freeze + SIGKILL + thaw kill, v1 limits) run for real, also on hybrid hosts."""

from __future__ import annotations

import dataclasses
import os
import tempfile

import pytest

from openk3.sandbox.api.service import SandboxService
from openk3.sandbox.linux import syscalls
from openk3.sandbox.protocol import Limits

pytestmark = pytest.mark.sandbox


def test_v1_freezer_path(service):
    if "freezer" not in service.backend.layout.v1_roots:
        pytest.skip("host has no cgroup v1 freezer hierarchy (pure v2): the v1 path cannot run here")
    state = tempfile.mkdtemp(prefix="openk3-sandbox-v1-", dir="/tmp")
    config = dataclasses.replace(service.backend.config, state_dir=state, store_bytes=256 * 2**20, cgroups="v1")
    svc = SandboxService(config)
    try:
        control_root = svc.backend.layout.control_root
        assert svc.backend.layout.name == "v1" and control_root is not None and control_root.endswith("freezer")
        sid = svc.create(limits=Limits(pids=32))
        r = svc.exec(sid, "setsid sleep 60 & (sh -c 'sleep 60 &' &); trap '' TERM; sleep 60", timeout_s=0.4)
        assert r.timed_out and r.exit_code == 137
        assert len(svc.backend.box(sid).cg.pids()) <= 3, "v1 kill left processes behind"
        svc.exec(sid, "echo v1 > /root/f")
        snap = svc.snapshot(sid)  # freezes through freezer.state
        svc.exec(sid, "rm /root/f")
        svc.restore(sid, snap.snapshot_id)
        assert svc.exec(sid, "cat /root/f").stdout == b"v1\n"
        shell = svc.open_shell(sid)
        assert svc.shell_run(shell, "X=1; sleep 60", timeout_s=0.3).timed_out  # freeze, kill all but the shell, thaw
        assert svc.shell_run(shell, "echo $X").stdout == b"1\n"
        svc.destroy(sid)
        svc.delete_snapshot(snap.snapshot_id)
    finally:
        svc.close()
    assert syscalls.mounts_under(state) == [] and not os.path.exists(state)
    freezer = service.backend.layout.v1_roots["freezer"]
    assert not os.path.exists(os.path.join(freezer, svc.backend.cg_prefix))
