"""Spec test plan 11: process snapshots of a Python-native environment through the fork server."""

from __future__ import annotations

import pytest

from openk3.sandbox.protocol import InvalidArgument, NotFound, SandboxError

pytestmark = pytest.mark.sandbox

FACTORY = "demo"


def test_process_snapshot_restore_fork(svc):
    eid = svc.create_env(FACTORY, {"ballast_mb": 8, "seed": 1})
    snap = None
    copies: list[str] = []
    try:
        for a in (1, 2, 3):
            svc.call_env(eid, "step", [a])
        at_snapshot = svc.call_env(eid, "state")
        snap = svc.snapshot(eid, kind="process")
        assert snap.kind.value == "process" and "memory" in snap.captures
        for a in (10, 20):
            svc.call_env(eid, "step", [a])  # parent moves on after the snapshot
        svc.call_env(eid, "set_position", [999])
        moved = svc.call_env(eid, "state")
        assert moved != at_snapshot

        copies = svc.fork(snap.snapshot_id, 3)
        for c in copies:
            assert svc.call_env(c, "state") == at_snapshot  # later parent mutations are invisible
        samples = {svc.call_env(c, "sample") for c in copies}
        assert len(samples) == 3, "each copy must be reseeded, not replay its siblings' random stream"
        svc.call_env(copies[0], "step", [5])
        assert svc.call_env(copies[1], "state") == at_snapshot  # copies are mutually invisible too
        assert svc.call_env(eid, "state") == moved

        svc.restore(eid, snap.snapshot_id)
        assert svc.call_env(eid, "state") == at_snapshot
        svc.restore(eid, snap.snapshot_id)
        assert svc.call_env(eid, "state") == at_snapshot  # restoring twice gives the same state

        live_forks = svc.fork(eid, 2)  # forking a live environment snapshots it first
        copies += live_forks
        assert all(svc.call_env(c, "state") == at_snapshot for c in live_forks)

        with pytest.raises(InvalidArgument):
            svc.call_env(eid, "_private")
        with pytest.raises(InvalidArgument, match="ValueError: invalid literal"):
            svc.call_env(eid, "step", ["x"])
        with pytest.raises(InvalidArgument):
            svc.snapshot(eid, kind="fs")
        with pytest.raises(NotFound):
            svc.call_env("pe-missing@x", "state")
    finally:
        for c in copies:
            svc.destroy(c)
        svc.destroy(eid)
        if snap is not None:
            svc.delete_snapshot(snap.snapshot_id)


def test_registered_factory_that_fails_is_a_clear_error(service):
    from openk3.sandbox.process.envs import ProcessEnvs
    from openk3.sandbox.process.registry import EnvFactories

    envs = ProcessEnvs(service.backend.layout, service.backend.cg_prefix, "h", service.backend.helper, EnvFactories({"broken": "no_such_module:Env"}))
    with pytest.raises(SandboxError, match="no_such_module"):
        envs.create("broken")
    assert envs.ids() == []
