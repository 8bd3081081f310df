"""A daemon killed with SIGKILL: the next one on its state dir serves its snapshots again (after re-hashing their layers) and
removes its sandboxes' processes, mounts and cgroups, also when the state dir was moved or the next daemon uses another dir.

The "crashed" daemons are real child processes (a NamespaceBackend in a fresh interpreter), killed with SIGKILL at a point
they report over a pipe, so nothing depends on timing: not the in-process objects of a fake crash.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from openk3.sandbox.api.client import SandboxClient
from openk3.sandbox.linux import syscalls
from openk3.sandbox.linux.cgroups import pids_under
from openk3.sandbox.namespace import recovery
from openk3.sandbox.namespace.backend import NamespaceBackend
from openk3.sandbox.namespace.settings import BackendConfig
from openk3.sandbox.protocol import Conflict, NotFound
from tests.sandbox.conftest import sandbox_uid
from tests.sandbox.test_cli_serve import SERVE, free_port, wait_healthy

pytestmark = pytest.mark.sandbox

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The daemon that will be killed. "snapshots": two snapshots of different contents and a process that would outlive its
# init; "freeze": blocked inside a snapshot while the sandbox's cgroup is frozen (the copy step never returns).
CHILD = """
import json, os, sys, threading
from openk3.sandbox.linux.cgroups import pids_under
from openk3.sandbox.namespace.backend import NamespaceBackend
from openk3.sandbox.namespace.settings import BackendConfig

mode, config = sys.argv[1], json.loads(sys.argv[2])
b = NamespaceBackend(BackendConfig(**config))
sid = b.create()
b.exec(sid, "printf one > /root/f; mkdir -p /root/d && printf keep > /root/d/g")
report = {"instance": b.instance_name, "control": os.path.join(b.layout.control_root, b.cg_prefix), "snapshots": []}
report["snapshots"].append(b.snapshot(sid).snapshot_id)
b.exec(sid, "printf two > /root/f; rm -r /root/d")
report["snapshots"].append(b.snapshot(sid).snapshot_id)
b.exec(sid, "setsid sleep 600 >/dev/null 2>&1 &")
if mode == "freeze":
    def stuck(upper, nbytes, ids=None):
        cg = b.box(sid).cg
        v2 = b.layout.v2_root is not None
        report["frozen"] = open(os.path.join(cg.control, "cgroup.freeze" if v2 else "freezer.state")).read().strip() in ("1", "FROZEN")
        report["pids"] = pids_under(report["control"])
        print(json.dumps(report), flush=True)
        threading.Event().wait()

    b.store.stage_copy = stuck
    b.exec(sid, "printf three > /root/f")
    b.snapshot(sid)
report["pids"] = pids_under(report["control"])
print(json.dumps(report), flush=True)
sys.stdin.read()
"""


def config_for(service, state: str, cgroups: str = "auto") -> BackendConfig:
    base = service.backend.config
    return BackendConfig(state_dir=state, cache_dir=base.cache_dir, store_bytes=256 * 2**20, sandbox_uid=base.sandbox_uid, cgroups=cgroups)


def new_state_dir() -> str:
    # Under /tmp, not pytest's 0700 tree: bwrap runs as the sandbox uid and must traverse the state dir's parents.
    return tempfile.mkdtemp(prefix="openk3-sandbox-crash-", dir="/tmp")


def crash(config: BackendConfig, mode: str = "snapshots") -> dict:
    """Run a daemon in a child process until it reports, then SIGKILL it; returns its report."""
    fields = {
        "state_dir": config.state_dir,
        "cache_dir": config.cache_dir,
        "store_bytes": config.store_bytes,
        "sandbox_uid": config.sandbox_uid,
        "cgroups": config.cgroups,
    }
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, mode, json.dumps(fields)],
        env={**os.environ, "PYTHONPATH": ROOT},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert child.stdout is not None and child.stderr is not None
    line = child.stdout.readline()
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert line, child.stderr.read().decode()
    report = json.loads(line)
    assert report["pids"], "the child's sandbox had no processes to leave behind"
    return report


def running(pid: int) -> bool:
    """Alive and not a zombie: a frozen process counts as running."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def exits(pid: int) -> bool:
    """The process has exited (zombie or reaped), waiting on a pidfd: a killed process leaves its cgroup before it is a
    zombie, so an empty cgroup alone does not mean its processes are done. The timeout only guards against a hang."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], 30.0)[0])
    finally:
        os.close(fd)


def assert_gone(report: dict) -> None:
    assert [p for p in report["pids"] if not exits(p)] == []
    assert not os.path.exists(report["control"])


def close_clean(backend: NamespaceBackend) -> None:
    state = backend.state
    backend.close()
    assert syscalls.mounts_under(state) == [] and not os.path.exists(state)


def manifest(backend_state: str, snapshot_id: str) -> str:
    return os.path.join(backend_state, "snapshots", snapshot_id + ".json")


def test_snapshots_survive_kill_9(service):
    config = config_for(service, new_state_dir())
    report = crash(config)
    fresh = NamespaceBackend(config)
    try:
        assert fresh.instance_name == report["instance"]
        assert_gone(report)
        assert syscalls.mounts_under(os.path.join(fresh.state, "sbx")) == []
        assert sorted(s.snapshot_id for s in fresh.snapshots()) == sorted(report["snapshots"])
        first, second = report["snapshots"]
        sid = fresh.create(image=first)
        assert fresh.exec(sid, "cat /root/f /root/d/g").stdout == b"onekeep"
        fresh.restore(sid, second)
        r = fresh.exec(sid, "cat /root/f; test -e /root/d || echo deleted")
        assert r.stdout == b"twodeleted\n"
        fresh.destroy(sid)
        fresh.store.check_integrity()
        for snap in report["snapshots"]:
            fresh.delete_snapshot(snap)
        assert fresh.store.refcounts() == {}
    finally:
        close_clean(fresh)


@pytest.mark.parametrize("cgroups", ["auto", "v1"])
def test_crash_mid_snapshot_leaves_nothing_frozen_or_half_made(service, cgroups):
    # v1: the sandbox's own freezer cgroup is self-frozen; thawing the instance's parent after the kill does not thaw it, so
    # its processes stayed frozen with SIGKILL pending until some later start. The restart must thaw it at once.
    if cgroups == "v1" and "freezer" not in service.backend.layout.v1_roots:
        pytest.skip("host has no cgroup v1 freezer hierarchy (pure v2): the v1 path cannot run here")
    config = config_for(service, new_state_dir(), cgroups)
    report = crash(config, mode="freeze")
    assert report["frozen"] and any(running(p) for p in report["pids"])  # frozen, not dead, when the daemon died
    fresh = NamespaceBackend(config)
    try:
        assert_gone(report)
        assert sorted(s.snapshot_id for s in fresh.snapshots()) == sorted(report["snapshots"])  # not the third
        assert os.listdir(fresh.store.tmp) == []
        fresh.store.check_integrity()
    finally:
        close_clean(fresh)


def test_half_written_and_altered_snapshots_are_discarded(service, caplog):
    config = config_for(service, new_state_dir())
    report = crash(config)
    first, second = report["snapshots"]
    state = os.path.realpath(config.state_dir)
    with open(manifest(state, second), "r+b") as f:  # cut short mid-write (a store that lost the tail)
        f.truncate(len(f.read()) // 2)
    with open(os.path.join(state, "snapshots", ".tmp-0123"), "wb") as f:  # the daemon died before its rename
        f.write(b'{"version": 1, "snap')
    with open(manifest(state, first)) as f:
        bottom = json.load(f)["snapshot"]["layers"][-1]
    layer_dir = os.path.join(state, "layers", bottom[:32])
    with open(os.path.join(layer_dir, "root", "f"), "ab") as f:  # a layer changed behind the daemon's back
        f.write(b"tampered")
    with caplog.at_level(logging.WARNING):
        fresh = NamespaceBackend(config)
    try:
        assert fresh.snapshots() == []
        logged = [r.getMessage() for r in caplog.records]
        assert [m for m in logged if first in m and "altered" in m], logged
        assert [m for m in logged if second in m and "unreadable manifest" in m], logged
        assert [m for m in logged if ".tmp-0123" in m and "never finished" in m], logged
        for snap in report["snapshots"]:
            with pytest.raises(NotFound):
                fresh.create(image=snap)
        assert os.listdir(os.path.join(fresh.state, "snapshots")) == []
        assert os.listdir(os.path.join(fresh.state, "layers")) == [".tmp"]  # the altered layer is gone, not served
    finally:
        close_clean(fresh)


def test_leftovers_cleaned_when_the_state_dir_moved(service):
    parent = new_state_dir()
    os.chmod(parent, 0o755)  # the sandbox uid traverses it
    config = config_for(service, os.path.join(parent, "state"))
    report = crash(config)
    moved = parent + "-moved"
    os.rename(parent, moved)  # the state tmpfs, its sandbox mounts and the dead instance's name go along
    elsewhere = NamespaceBackend(config_for(service, new_state_dir()))
    try:
        assert elsewhere.instance_name != report["instance"]
        assert_gone(report)
        assert [p for p in syscalls.mounts_under(moved) if p != os.path.join(moved, "state")] == []
    finally:
        close_clean(elsewhere)
    back = NamespaceBackend(config_for(service, os.path.join(moved, "state")))  # the moved dir still holds its snapshots
    try:
        assert back.instance_name == report["instance"]
        sid = back.create(image=report["snapshots"][0])
        assert back.exec(sid, "cat /root/f").stdout == b"one"
        back.destroy(sid)
        for snap in report["snapshots"]:
            back.delete_snapshot(snap)
    finally:
        close_clean(back)
    shutil.rmtree(moved)


def test_a_live_daemon_keeps_its_state_dir(service):
    with pytest.raises(Conflict, match="is running on it"):
        NamespaceBackend(config_for(service, service.backend.state))
    assert recovery.state_mounts()[service.backend.state] == service.backend.instance_name


def test_close_keeping_snapshots_then_reopen(service):
    config = config_for(service, new_state_dir())
    first = NamespaceBackend(config)
    sid = first.create()
    first.exec(sid, "printf kept > /root/f")
    snap = first.snapshot(sid).snapshot_id
    control = os.path.join(first.layout.control_root or "", first.cg_prefix)
    first.close(keep_snapshots=True)
    assert not os.path.exists(control) and syscalls.mounts_under(os.path.join(first.state, "sbx")) == []
    again = NamespaceBackend(config)
    try:
        sid = again.create(image=snap)
        assert again.exec(sid, "cat /root/f").stdout == b"kept"
        again.destroy(sid)
        again.delete_snapshot(snap)
    finally:
        close_clean(again)
    assert pids_under(control) == []


def serve(state: str, port: int) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-c", SERVE, "sandbox", "serve", "--port", str(port), "--state-dir", state, "--store-bytes", str(256 * 2**20)]
    proc = subprocess.Popen(
        [*argv, "--workers", "2", "--sandbox-uid", str(sandbox_uid())], env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    wait_healthy(proc, port)
    return proc


def test_openk3_sandbox_serve_killed_and_restarted(host_features):
    state = new_state_dir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    first = serve(state, port)
    try:
        with SandboxClient(url) as c:
            sid = c.create()
            c.write_file(sid, "/root/data.bin", bytes(range(256)) * 4)
            c.exec(sid, "setsid sleep 600 >/dev/null 2>&1 &")
            snap = c.snapshot(sid).snapshot_id
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    second = serve(state, port)
    try:
        with SandboxClient(url) as c:
            sid = c.create(image=snap)
            assert c.read_file(sid, "/root/data.bin") == bytes(range(256)) * 4
            c.destroy(sid)
    finally:
        second.send_signal(signal.SIGTERM)
        out = second.communicate(timeout=60)[0]
    assert second.returncode == 0, out
    assert syscalls.mounts_under(state) == [] and not os.path.exists(state)
