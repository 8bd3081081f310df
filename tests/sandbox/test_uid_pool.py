"""namespace/uids.py: each live sandbox holds a host uid no other live sandbox or host process has, given back on destroy and
handed out again lowest first; a daemon (re)started while something still runs as an id of its range never hands that id out."""

from __future__ import annotations

import os
import subprocess

import pytest

from openk3.sandbox.namespace.settings import BackendConfig
from openk3.sandbox.namespace.uids import UidPool, running_uids
from openk3.sandbox.protocol import Busy
from tests.sandbox.conftest import started, state_dir

pytestmark = pytest.mark.sandbox


def test_running_uids_reads_every_uid_of_each_process(tmp_path):
    for pid, line in (("1", "Uid:\t0\t0\t0\t0"), ("7", "Uid:\t100003\t100005\t100003\t100009"), ("self", "Uid:\t100001\t0\t0\t0")):
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "status").write_text(f"Name:\tx\n{line}\nGid:\t0\t0\t0\t0\n")
    (tmp_path / "9").mkdir()  # exited between the listing and the read: no status
    assert running_uids(100_000, 100_009, str(tmp_path)) == {100_003, 100_005}


def test_pool_hands_out_each_id_once_skips_strangers_and_recycles_lowest_first(svc):
    base = svc.backend.config.sandbox_uid or 100_000
    pool = UidPool(base, 5, svc.backend.helper.path, in_use={base + 2})
    try:
        taken = [pool.take()[0] for _ in range(3)]
        assert taken == [base + 1, base + 3, base + 4]
        with pytest.raises(Busy):
            pool.take()
        pool.release(base + 4)
        pool.release(base + 1)
        pool.check_integrity()
        assert pool.held() == [base + 3]
        assert [pool.take()[0], pool.take()[0]] == [base + 1, base + 4]
        pool.check_integrity()
    finally:
        pool.close()


def test_sandboxes_hold_distinct_uids_until_destroyed(svc):
    if svc.backend.uids is None:
        pytest.skip("sandbox_uid=None: no pool")
    sids = [svc.create() for _ in range(3)]
    uids = [svc.backend.box(s).uid for s in sids]
    assert len(set(uids)) == 3 and svc.backend.uids.held() == sorted(uids)
    # the host's view: each sandbox's init runs as its own uid
    for sid, uid in zip(sids, uids, strict=True):
        with open(f"/proc/{svc.backend.box(sid).init_pid}/uid_map") as f:
            assert f.read().split() == ["0", str(uid), "1"]
    svc.destroy(sids[1])
    assert svc.backend.uids.held() == sorted([uids[0], uids[2]])
    replacement = svc.create()
    try:
        assert svc.backend.box(replacement).uid == uids[1]
    finally:
        for sid in (sids[0], sids[2], replacement):
            svc.destroy(sid)


def test_a_daemon_skips_ids_that_still_run_a_process(svc):
    """As after a restart whose recovery left a process of a dead sandbox running, or beside a daemon given the same range."""
    if svc.backend.uids is None:
        pytest.skip("sandbox_uid=None: no pool")
    base = svc.backend.uids.base
    # the id a new pool would hand out first (other daemons on this host, other test runs, may use some of the range)
    first = min(set(range(base + 1, base + 1000)) - running_uids(base, base + 1000))
    straggler = subprocess.Popen(["sleep", "1000"], user=first, group=first, stdin=subprocess.DEVNULL)
    try:
        config = BackendConfig(state_dir=state_dir(), cache_dir=svc.backend.config.cache_dir, store_bytes=256 * 2**20, sandbox_uid=base)
        for other in started(config):
            sid = other.create()
            try:
                assert other.backend.box(sid).uid != first
            finally:
                other.destroy(sid)
            assert other.backend.uids is not None
            other.backend.uids.check_integrity()
    finally:
        straggler.kill()
        straggler.wait()
    assert not os.path.exists(config.state_dir)
