"""Spec test plan 3-7: timeouts kill whole trees, memory, pids, CPU and disk limits."""

from __future__ import annotations

import os
import time

import pytest

from openk3.sandbox.protocol import Limits

pytestmark = pytest.mark.sandbox

ESCAPES = {
    "sleep": "sleep 60",
    "setsid": "setsid sleep 60 & sleep 60",
    "nohup": "nohup sleep 60 >/dev/null 2>&1 & sleep 60",
    "double-fork": "(sh -c 'sleep 60 &' &); sleep 60",
    "trap TERM": "trap '' TERM; sh -c \"trap '' TERM; sleep 60\"",
    "closed pipes": "exec >/dev/null 2>&1; setsid sleep 60",
}


def test_timeout_kills_whole_tree(svc):
    sid = svc.create()
    try:
        baseline = len(svc.backend.box(sid).cg.pids())
        for name, cmd in ESCAPES.items():
            t0 = time.monotonic()
            r = svc.exec(sid, cmd, timeout_s=0.4)
            wall = time.monotonic() - t0
            assert r.timed_out and r.exit_code == 137, name
            assert wall <= 0.4 + 0.1, (name, wall)  # the spec's budget; the deadline counts from before the spawn
            assert len(svc.backend.box(sid).cg.pids()) == baseline, f"{name}: processes survived the timeout"
            assert svc.exec(sid, "echo alive").stdout == b"alive\n", name
    finally:
        svc.destroy(sid)


def test_a_deadline_that_passes_before_the_command_starts_still_holds(svc):
    """A deadline can pass, and a shell be closed, before openk3-enter has joined the command's cgroup, so a cgroup kill
    alone would miss the helper and the command it is about to start: it is killed first."""
    sid = svc.create()
    try:
        baseline = len(svc.backend.box(sid).cg.pids())
        for _ in range(5):
            r = svc.exec(sid, "sleep 30; echo late", timeout_s=1e-6)
            assert r.timed_out and r.exit_code == 137 and r.stdout == b"", r
            assert len(svc.backend.box(sid).cg.pids()) == baseline
            svc.close_shell(svc.open_shell(sid))  # closed at once: must neither hang nor leave a shell behind
            assert len(svc.backend.box(sid).cg.pids()) == baseline
    finally:
        svc.destroy(sid)


def test_memory_limit_oom_kills_inside_only(svc):
    sid = svc.create(limits=Limits(memory_bytes=64 * 2**20, disk_bytes=512 * 2**20))
    try:
        r = svc.exec(sid, "dd if=/dev/zero of=/dev/null bs=200M count=1")
        assert r.oom_killed and r.exit_code == 137
        # tmpfs pages the sandbox writes are charged to it as well
        r = svc.exec(sid, "dd if=/dev/zero of=/tmp/fill bs=1M count=200")
        assert r.oom_killed and r.exit_code == 137
        assert (svc.stats(sid).memory_bytes or 0) <= 64 * 2**20  # the charge stayed inside the limit, not on the host
        assert svc.exec(sid, "rm -f /tmp/fill; echo ok").stdout == b"ok\n"
        assert not svc.exec(sid, "dd if=/dev/zero of=/dev/null bs=8M count=1").oom_killed
    finally:
        svc.destroy(sid)


def test_pids_limit_stops_fork_bomb(svc):
    sid = svc.create(limits=Limits(pids=32))
    try:
        cg = svc.backend.box(sid).cg
        refused = cg.pids_refused() or 0
        # the foreground waits in a builtin loop: an external `sleep` may itself fail to fork once the bomb holds every pid,
        # and the shell would then exit before the timeout (seen under load)
        r = svc.exec(sid, "bomb() { bomb | bomb & }; bomb; while :; do :; done", timeout_s=2)
        assert r.timed_out
        assert (cg.pids_refused() or 0) > refused, "the fork bomb never hit the pids limit"
        assert len(cg.pids()) <= 4, "the bomb's processes must be gone after its timeout"
        r = svc.exec(sid, "for i in $(seq 64); do sleep 5 & done; wait", timeout_s=2)
        assert b"fork" in r.stderr.lower() or b"resource temporarily unavailable" in r.stderr.lower()
        assert svc.exec(sid, "echo alive").stdout == b"alive\n"
    finally:
        svc.destroy(sid)


def test_cpu_quota_holds(svc):
    cpus = 0.3
    sid = svc.create(limits=Limits(cpus=cpus))
    try:
        if svc.stats(sid).cpu_usage_s is None:
            pytest.skip("no cgroup v2 cpu.stat on this host to measure CPU usage with")
        before = svc.stats(sid).cpu_usage_s or 0.0
        t0 = time.monotonic()
        svc.exec(sid, "spin() { while :; do :; done; }; spin & spin & spin", timeout_s=2.0)
        wall = time.monotonic() - t0
        used = (svc.stats(sid).cpu_usage_s or 0.0) - before
        assert used <= cpus * wall * 1.10, (used, wall)
        # lower bound only proves the loops ran (other jobs share these 2 cores); the quota is the upper bound above
        assert used >= cpus * wall * 0.25, f"busy loops barely ran ({used:.2f}s): the check above proves nothing"
    finally:
        svc.destroy(sid)


def test_disk_quota_enospc_inside_only(svc):
    sid = svc.create(limits=Limits(disk_bytes=8 * 2**20))
    host_free = os.statvfs("/tmp").f_bavail
    try:
        r = svc.exec(sid, "dd if=/dev/zero of=/root/big bs=1M count=32")
        assert r.exit_code != 0 and b"No space left on device" in r.stderr
        assert svc.stats(sid).disk_used_bytes <= 8 * 2**20
        svc.exec(sid, "rm /root/big")
        assert svc.exec(sid, "echo small > /root/ok && cat /root/ok").stdout == b"small\n"
    finally:
        svc.destroy(sid)
    assert abs(os.statvfs("/tmp").f_bavail - host_free) * os.statvfs("/tmp").f_frsize < 4 * 2**20
