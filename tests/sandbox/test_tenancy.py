"""Tenancy: a key names a tenant, and a tenant reaches its own sandboxes, snapshots, processes and shells only, within its
quotas. Every attack from one tenant on another's objects is a 404 indistinguishable from an id that never existed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from openk3.sandbox.api import auth, tenants
from openk3.sandbox.api.client import SandboxClient
from openk3.sandbox.api.server import create_app
from openk3.sandbox.api.tenant_ledger import TenantLedger
from openk3.sandbox.api.tenants import Tenant, Tenants
from openk3.sandbox.protocol import InvalidArgument, NotFound, QuotaExceeded, Unauthorized
from tests.sandbox.test_api import running
from tests.sandbox.test_cli_serve import ROOT, SERVE
from tests.sandbox.test_output_budget import metric

KEY_OPS, KEY_A, KEY_B = "o" * 32, "a" * 32, "b" * 32


def keys_file(tmp_path, doc: object, mode: int = 0o600) -> str:
    path = str(tmp_path / "keys.json")
    with open(path, "w") as f:
        f.write(doc if isinstance(doc, str) else json.dumps(doc))
    os.chmod(path, mode)
    return path


def test_keys_file_format_and_refusals(tmp_path):
    doc = {
        "tenants": [
            {"name": "ops", "key": KEY_OPS, "operator": True},
            {"name": "team-a", "key": KEY_A, "max_sandboxes": 2, "max_store_bytes": 1 << 20},
        ]
    }
    loaded = tenants.load(keys_file(tmp_path, doc))
    assert loaded.identify(KEY_A) == Tenant("team-a", KEY_A, 2, 1 << 20) and loaded.identify(KEY_OPS).operator  # type: ignore[union-attr]
    assert loaded.identify(KEY_A + "x") is None and loaded.identify(KEY_A[:-1]) is None and loaded.identify(None) is None
    assert KEY_A not in repr(loaded.by_name["team-a"])  # keys never reach a log line through repr
    with pytest.raises(InvalidArgument, match="mode 644 lets others read"):
        tenants.load(keys_file(tmp_path, doc, 0o644))
    bad = [
        ({"tenants": [{"name": "a", "key": "short"}]}, "at least 16"),
        ({"tenants": [{"name": "a", "key": KEY_A}, {"name": "b", "key": KEY_A}]}, "share a key"),
        ({"tenants": [{"name": "a", "key": KEY_A}, {"name": "a", "key": KEY_B}]}, "distinct"),
        ({"tenants": [{"name": "A/..", "key": KEY_A}]}, "a-z 0-9"),
        ({"tenants": [{"name": "a", "key": KEY_A, "max_sandbox": 3}]}, "unknown fields"),
        ({"tenants": [{"name": "a", "key": KEY_A, "max_sandboxes": -1}]}, "max_sandboxes=-1"),
        ({"tenants": [{"name": "a", "key": KEY_A, "operator": "yes"}]}, "operator"),
        ({"tenants": []}, "at least one tenant"),
        ("[", "not JSON"),
    ]
    for doc_text, match in bad:
        with pytest.raises(InvalidArgument, match=match):
            tenants.parse(doc_text if isinstance(doc_text, str) else json.dumps(doc_text))


def test_serve_refuses_a_readable_keys_file_and_a_second_key(tmp_path):
    """A keys file others can read is refused before anything is mounted, and so is a keys file beside a single key."""
    env = {k: v for k, v in os.environ.items() if k != auth.ENV_VAR}
    state = str(tmp_path / "state")
    path = keys_file(tmp_path, {"tenants": [{"name": "a", "key": KEY_A}]}, 0o640)
    argv = [sys.executable, "-c", SERVE, "sandbox", "serve", "--host", "0.0.0.0", "--state-dir", state, "--keys-file", path]
    done = subprocess.run(argv, env={**env, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "mode 640 lets others read" in done.stdout, done
    os.chmod(path, 0o600)
    done = subprocess.run([*argv, "--api-key", KEY_B], env={**env, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "give one" in done.stdout, done
    assert not os.path.exists(state)


def test_ledger_counts_reaped_sandboxes_out_and_refuses_past_the_quotas():
    a, b = Tenant("a", KEY_A, max_sandboxes=2, max_store_bytes=1000), Tenant("b", KEY_B)
    live: set[str] = set()
    ledger = TenantLedger(Tenants([a, b]), lambda: set(live))
    with ledger.reserve_sandboxes(a, 2):
        with pytest.raises(QuotaExceeded, match="max_sandboxes=2"):  # slots held by a create in flight count
            with ledger.reserve_sandboxes(a, 1):
                pass
        live.update({"sb-1", "sb-2"})
        ledger.adopt(a, "sb-1", "sb-2")
    with ledger.reserve_sandboxes(b, 5):  # b has no limit, and a's sandboxes are not b's
        pass
    live.discard("sb-1")  # the TTL reaper destroyed it: the slot is free again
    with ledger.reserve_sandboxes(a, 1):
        pass
    assert not ledger.owns(a, "sb-1") and ledger.owns(a, "sb-2") and not ledger.owns(b, "sb-2")
    charge = ledger.charge(a)
    charge(1000)  # exactly the quota is allowed
    ledger.settle(a, "snap-1", 600)
    with pytest.raises(QuotaExceeded, match="hold 600 bytes .* 401 more, over max_store_bytes=1000"):
        charge(401)
    ledger.charge(b)(10**15)  # no store limit
    assert ledger.figures() == {"a": (1, 600, {"sandboxes": 1, "store_bytes": 1}), "b": (0, 0, {})}
    ledger.forget("snap-1")
    charge(1000)


def attacks(client: SandboxClient, sandbox_id: str, snapshot_id: str, process_id: str, shell_id: str, pty_id: str, watch_id: str) -> list[tuple[str, object]]:
    """Every call another tenant's ids can be passed to: (what, thunk)."""
    return [
        ("exec", lambda: client.exec(sandbox_id, "id")),
        ("spawn", lambda: client.spawn(sandbox_id, "id")),
        ("read_file", lambda: client.read_file(sandbox_id, "/etc/hostname")),
        ("write_file", lambda: client.write_file(sandbox_id, "/tmp/x", b"x")),
        ("list_dir", lambda: client.list_dir(sandbox_id, "/")),
        ("upload_tar", lambda: client.upload_tar(sandbox_id, b"")),
        ("download_tar", lambda: client.download_tar(sandbox_id, "/etc")),
        ("open_shell", lambda: client.open_shell(sandbox_id)),
        ("stats", lambda: client.stats(sandbox_id)),
        ("heartbeat", lambda: client.heartbeat(sandbox_id)),
        ("snapshot", lambda: client.snapshot(sandbox_id)),
        ("fork sandbox", lambda: client.fork(sandbox_id, 1)),
        ("fork snapshot", lambda: client.fork(snapshot_id, 1)),
        ("create from snapshot", lambda: client.create(image=snapshot_id)),
        ("restore onto", lambda: client.restore(sandbox_id, snapshot_id)),
        ("export_snapshot", lambda: client.export_snapshot(snapshot_id)),
        ("process_status", lambda: client.process_status(process_id)),
        ("process_output", lambda: client.process_output(process_id)),
        ("process_wait", lambda: client.process_wait(process_id, timeout_s=1)),
        ("process_write_stdin", lambda: client.process_write_stdin(process_id, b"x")),
        ("process_close_stdin", lambda: client.process_close_stdin(process_id)),
        ("process_signal", lambda: client.process_signal(process_id, "TERM")),
        ("process_kill", lambda: client.process_kill(process_id)),
        ("pty_create", lambda: client.pty_create(sandbox_id)),
        ("pty_write", lambda: client.pty_write(pty_id, b"id\n")),
        ("pty_resize", lambda: client.pty_resize(pty_id, 10, 10)),
        ("pty_read", lambda: client.pty_read(pty_id)),
        ("pty_status", lambda: client.pty_status(pty_id)),
        ("pty_wait", lambda: client.pty_wait(pty_id, timeout_s=0)),
        ("pty_kill", lambda: client.pty_kill(pty_id)),
        ("watch_dir", lambda: client.watch_dir(sandbox_id, "/root")),
        ("watch_events", lambda: client.watch_events(watch_id)),
        ("watch_stop", lambda: client.watch_stop(watch_id)),
        ("shell_run", lambda: client.shell_run(shell_id, "id")),
        ("close_shell", lambda: client.close_shell(shell_id)),
        ("delete_snapshot", lambda: client.delete_snapshot(snapshot_id)),
        ("destroy", lambda: client.destroy(sandbox_id)),
    ]


def refusal(thunk) -> str:
    with pytest.raises(NotFound) as caught:
        thunk()
    return str(caught.value)


@pytest.mark.sandbox
def test_a_tenant_cannot_see_or_touch_another_tenants_objects(svc):
    keys = Tenants([Tenant("ops", KEY_OPS, operator=True), Tenant("a", KEY_A), Tenant("b", KEY_B)])
    with (
        running(create_app(svc, workers=2, reap_interval_s=None, tenants=keys)) as url,
        SandboxClient(url, api_key=KEY_A) as a,
        SandboxClient(url, api_key=KEY_B) as b,
    ):
        sid = b.create(labels={"team": "b"})
        b.write_file(sid, "/root/secret", b"b's data")
        snap = b.snapshot(sid).snapshot_id
        pid = b.spawn(sid, "sleep 300", stdin=True)
        shell = b.open_shell(sid)
        pty = b.pty_create(sid, "sleep 300")
        watch = b.watch_dir(sid, "/root")
        mine = a.create(labels={"team": "b"})  # the same labels: still only a's own in a's list
        try:
            assert [i.sandbox_id for i in a.list_sandboxes()] == [mine] and [i.sandbox_id for i in a.list_sandboxes({"team": "b"})] == [mine]
            assert [i.sandbox_id for i in b.list_sandboxes()] == [sid]
            for what, thunk in attacks(a, sid, snap, pid, shell, pty, watch):
                foreign = refusal(thunk)
                # the same call with ids that never existed: the same answer, so a refusal tells nothing about b
                fakes = ("sb-0000deadbeef@h", "snap-0000deadbeef@h", "bg-0000deadbeef", "sh-0000deadbeef", "pty-0000deadbeef", "wt-0000deadbeef")
                never = refusal(dict(attacks(a, *fakes))[what])  # type: ignore[arg-type]
                for real, fake in zip((sid, snap, pid, shell, pty, watch), fakes, strict=True):
                    foreign = foreign.replace(real, fake)
                assert foreign == never, what
            with pytest.raises(NotFound):  # restoring one's own sandbox onto another's snapshot
                a.restore(mine, snap)
            assert httpx.get(f"{url}/v1/health", headers={"Authorization": f"Bearer {KEY_A}"}).json()["sandboxes"] == 1
            # b's objects came through untouched
            assert b.read_file(sid, "/root/secret") == b"b's data" and b.process_status(pid).running
            assert b.pty_status(pty).running and b.watch_events(watch).active
            assert b.shell_run(shell, "cat /root/secret").stdout == b"b's data"
            (child,) = b.fork(snap, 1)
            b.destroy(child)
            # /metrics covers every tenant: the operator's only
            assert httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY_A}"}).status_code == 404
            scraped = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY_OPS}"})
            assert scraped.status_code == 200
            assert metric(scraped.text, "openk3_sandbox_tenant_sandboxes", {"tenant": "b"}) == 1
            assert metric(scraped.text, "openk3_sandbox_tenant_sandboxes", {"tenant": "a"}) == 1
            with pytest.raises(Unauthorized), SandboxClient(url, api_key="x" * 32) as stranger:
                stranger.list_sandboxes()
        finally:
            b.process_kill(pid)
            b.delete_snapshot(snap)
            b.destroy(sid)
            a.destroy(mine)
        assert a.list_sandboxes() == [] and svc.backend.sandboxes() == []


@pytest.mark.sandbox
def test_tenant_quotas_refuse_creates_forks_and_snapshots_past_them(svc):
    keys = Tenants([Tenant("ops", KEY_OPS, operator=True), Tenant("a", KEY_A, max_sandboxes=2, max_store_bytes=256 << 10)])
    with running(create_app(svc, workers=2, reap_interval_s=None, tenants=keys)) as url, SandboxClient(url, api_key=KEY_A) as a:
        first = a.create()
        made = [first]
        try:
            with pytest.raises(QuotaExceeded, match="max_sandboxes=2"):
                a.fork(first, 2)  # 1 live + 2 would be 3
            made += a.fork(first, 1)
            with pytest.raises(QuotaExceeded, match="max_sandboxes=2"):
                a.create()
            a.destroy(made.pop())
            made.append(a.create())  # a destroyed sandbox frees its slot
            a.write_file(first, "/root/small", b"s" * 1000)
            small = a.snapshot(first)
            snapshots_before = {s.snapshot_id for s in svc.backend.snapshots()}
            layers_before = svc.backend.store.refcounts()
            a.exec(first, "head -c 1048576 /dev/urandom > /root/big")
            with pytest.raises(QuotaExceeded, match="max_store_bytes=262144"):
                a.snapshot(first)  # 1 MiB of new layer past a 256 KiB quota
            assert {s.snapshot_id for s in svc.backend.snapshots()} == snapshots_before  # refused before it was made:
            # No layer was written for it. Counts are not compared: standbys built and torn down in the background (the
            # snapshot's prewarm, the destroyed sandbox's teardown) move existing layers' counts at any moment.
            assert set(svc.backend.store.refcounts()) == set(layers_before)
            scraped = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY_OPS}"}).text
            assert metric(scraped, "openk3_sandbox_tenant_quota_refusals_total", {"tenant": "a", "quota": "sandboxes"}) == 2
            assert metric(scraped, "openk3_sandbox_tenant_quota_refusals_total", {"tenant": "a", "quota": "store_bytes"}) == 1
            assert 0 < metric(scraped, "openk3_sandbox_tenant_store_bytes", {"tenant": "a"}) < 256 << 10
            a.delete_snapshot(small.snapshot_id)
        finally:
            for sid in made:
                a.destroy(sid)
