"""Escape suite, API and neighbours (issue 18 item 3 and the attacks that already failed before it): a caller cannot pick the
code a host-side environment imports or call the daemon's own maintenance, one sandbox cannot see or signal another's
processes, and restoring A's snapshot into B gives B exactly A's files while A and B stay separate."""

from __future__ import annotations

import os
import secrets

import httpx
import pytest

from openk3.sandbox.api.server import create_app
from openk3.sandbox.process.registry import BUILTIN, EnvFactories
from openk3.sandbox.protocol import InvalidArgument
from tests.sandbox.test_api import running
from tests.sandbox.test_escape_env import host_cmdlines

pytestmark = pytest.mark.sandbox


def test_env_factories_come_from_the_operators_allow_list(svc, tmp_path):
    marker = tmp_path / "imported"
    for factory in ("os:system", "subprocess:getoutput", "openk3.sandbox.process.demo_env:RandomWalkEnv"):
        with pytest.raises(InvalidArgument, match="not a registered environment factory"):
            svc.create_env(factory)
    with pytest.raises(InvalidArgument, match="pythonpath"):
        svc.create_env("demo", pythonpath=[str(tmp_path)])
    with running(create_app(svc, workers=2, reap_interval_s=None)) as url:
        r = httpx.post(f"{url}/v1/create_env", json={"factory": "os:system", "kwargs": {"command": f"touch {marker}"}})
        assert r.status_code == 400 and r.json()["error"]["type"] == "InvalidArgument"
        assert "--env-factory" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/create_env", json={"factory": "demo", "pythonpath": [str(tmp_path)]})
        assert r.status_code == 400 and "pythonpath" in r.json()["error"]["message"]
    assert not marker.exists() and svc.envs.ids() == []
    eid = svc.create_env("demo", {"seed": 3})  # the built-in demo stays available
    svc.destroy(eid)


def test_reaping_is_not_an_api_call(svc):
    """`reap_expired(now=...)` is the daemon's maintenance: over HTTP, a `now` far in the future destroyed every sandbox."""
    sid = svc.create(ttl_s=3600)
    try:
        with running(create_app(svc, workers=2, reap_interval_s=None)) as url:
            for body in ({"now": 1e12}, {}):
                r = httpx.post(f"{url}/v1/reap_expired", json=body)
                assert r.status_code == 404 and r.json()["error"]["type"] == "NotFound", r.text
                assert "reap_expired" in r.json()["error"]["message"]
            r = httpx.post(f"{url}/v1/close", json={})
            assert r.status_code == 404
        assert svc.backend.sandboxes() == [sid] and svc.exec(sid, "echo alive").stdout == b"alive\n"
    finally:
        svc.destroy(sid)


def test_env_kwargs_are_on_no_host_command_line(svc):
    """The factory's kwargs are the caller's: they reach the fork server over its socket, not its world-readable cmdline."""
    seed = 10**12 + secrets.randbelow(10**12)
    eid = svc.create_env("demo", {"seed": seed})
    try:
        assert [pid for pid, line in host_cmdlines().items() if str(seed).encode() in line] == []
    finally:
        svc.destroy(eid)


def test_env_factory_registry_validates_the_operators_entries():
    assert EnvFactories().factories == BUILTIN
    parsed = EnvFactories.parse(["mine=pkg.tasks:Make"], ["/opt/tasks"])
    assert parsed.resolve("mine") == "pkg.tasks:Make" and parsed.resolve("demo") == BUILTIN["demo"] and parsed.pythonpath == ("/opt/tasks",)
    for entries, paths, field in (
        (["nameless"], [], "--env-factory 'nameless'"),
        (["x=not a spec"], [], "env factory x="),
        (["Bad Name=a:b"], [], "env factory name"),
        ([], ["relative/dir"], "env pythonpath"),
    ):
        with pytest.raises(InvalidArgument, match=field):
            EnvFactories.parse(entries, paths)


def test_other_sandboxes_processes_are_invisible_and_unsignalable(svc):
    a, b = svc.create(), svc.create()
    try:
        svc.exec(b, "nohup sleep 300 >/dev/null 2>&1 &")
        b_box = svc.backend.box(b)
        b_pids = set(b_box.cg.pids())
        assert len(b_pids) >= 3  # bwrap, its init and the sleep
        seen = {int(p) for p in svc.exec(a, "ls /proc | grep -E '^[0-9]+$'").stdout.split()}
        assert seen and all(p < 100 for p in seen)  # only a's own small pid-namespace numbers
        for pid in b_pids:
            r = svc.exec(a, f"kill -9 {pid}")
            assert r.exit_code != 0, pid
        assert set(b_box.cg.pids()) == b_pids  # nothing of b died
        assert svc.exec(a, "cat /proc/1/cmdline | tr '\\0' ' '").stdout.startswith(b"/bin/bash")  # a's pid 1 is a's init
    finally:
        svc.destroy(a)
        svc.destroy(b)


def test_snapshot_of_a_restored_into_b(svc):
    a, b = svc.create(), svc.create()
    snap = None
    try:
        svc.exec(a, "echo a-secret > /root/a && mkdir -p /work/a")
        svc.exec(b, "echo b-own > /root/b && nohup sleep 300 >/dev/null 2>&1 &")
        snap = svc.snapshot(a)
        svc.restore(b, snap.snapshot_id)
        r = svc.exec(b, "cat /root/a; test -e /root/b || echo b-file-gone; cat /proc/[0-9]*/comm | grep -c '^sleep$'")
        assert r.stdout == b"a-secret\nb-file-gone\n0\n"  # b's files and processes are gone, a's files are there
        svc.exec(b, "echo changed-in-b > /root/a")
        assert svc.exec(a, "cat /root/a").stdout == b"a-secret\n"  # ... as a copy: a does not see b's writes
        assert os.path.basename(svc.backend.box(a).dir) != os.path.basename(svc.backend.box(b).dir)
    finally:
        svc.destroy(a)
        svc.destroy(b)
        if snap is not None:
            svc.delete_snapshot(snap.snapshot_id)
