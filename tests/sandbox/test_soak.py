"""Spec test plan 12: 1,000 create -> exec -> snapshot -> fork -> destroy cycles leave nothing behind."""

from __future__ import annotations

import os
import statistics
import time

import pytest

from openk3.sandbox.linux import syscalls

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

CYCLES = int(os.environ.get("OPENK3_SANDBOX_SOAK_CYCLES", "1000"))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def store_used(svc) -> int:
    st = os.statvfs(svc.backend.state)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_soak_cycles_leave_nothing(svc, record_property):
    times: dict[str, list[float]] = {k: [] for k in ("create", "exec", "snapshot", "fork", "destroy")}

    def timed(name, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        times[name].append((time.perf_counter() - t0) * 1000)
        return out

    used0, fds0 = store_used(svc), len(os.listdir("/proc/self/fd"))
    rss_after_warmup = None
    for i in range(CYCLES):
        sid = timed("create", svc.create)
        r = timed("exec", svc.exec, sid, f"echo {i} > /root/f")
        assert r.exit_code == 0
        snap = timed("snapshot", svc.snapshot, sid)
        (child,) = timed("fork", svc.fork, snap.snapshot_id, 1)
        timed("destroy", svc.destroy, child)
        timed("destroy", svc.destroy, sid)
        svc.delete_snapshot(snap.snapshot_id)
        if i == min(50, CYCLES - 1):
            rss_after_warmup = rss_bytes()
    assert syscalls.mounts_under(os.path.join(svc.backend.state, "sbx")) == []
    assert svc.backend.store.refcounts() == {}
    assert store_used(svc) <= used0 + 1 * 2**20, "tmpfs usage must return to where it started"
    assert len(os.listdir("/proc/self/fd")) <= fds0 + 2, "file descriptors leaked"
    assert rss_after_warmup is not None and rss_bytes() - rss_after_warmup < 64 * 2**20, "daemon memory kept growing"
    for name, values in times.items():
        p50 = statistics.median(values)
        p99 = sorted(values)[int(0.99 * (len(values) - 1))]
        record_property(f"{name}_p50_ms", round(p50, 2))
        record_property(f"{name}_p99_ms", round(p99, 2))
        print(f"soak {name}: p50 {p50:.1f} ms, p99 {p99:.1f} ms over {len(values)}")
