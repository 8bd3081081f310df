"""Exec basics, host-side file API, tar transfer, shell sessions, stats, TTL reaping."""

from __future__ import annotations

import io
import os
import signal
import tarfile
import time

import pytest

from openk3.sandbox.protocol import Conflict, InvalidArgument, Limits, NotFound, QuotaExceeded

pytestmark = pytest.mark.sandbox


def test_exec_basics(svc):
    sid = svc.create(env={"GREETING": "hi"})
    try:
        r = svc.exec(sid, 'echo "$GREETING $EXTRA"; echo err >&2; pwd; exit 3', env={"EXTRA": "there"})
        assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, b"hi there\n/root\n", b"err\n", False)
        r = svc.exec(sid, ["cat"], stdin=b"x" * 100_000, cwd="/tmp")
        assert r.stdout == b"x" * 100_000 and r.exit_code == 0
        r = svc.exec(sid, "yes | head -c 3000000", max_output_bytes=1000)
        assert r.truncated and len(r.stdout) == 1000 and r.exit_code == 0
        r = svc.exec(sid, "id -u; hostname; grep CapEff /proc/self/status; ls /proc | grep -c '^[0-9]'")
        uid, host, caps, nprocs = r.stdout.decode().split("\n")[:4]
        assert (uid, host, caps.split()[1]) == ("0", "sandbox", "0000000000000000")
        assert int(nprocs) <= 5, "the sandbox sees only its own processes"
        with pytest.raises(InvalidArgument):
            svc.exec(sid, "true", timeout_s=0)
        with pytest.raises(NotFound):
            svc.exec("sb-nope@host", "true")
    finally:
        svc.destroy(sid)


def test_file_api_and_tar(svc):
    sid = svc.create(limits=Limits(disk_bytes=4 * 2**20))
    try:
        svc.write_file(sid, "/root/a.txt", b"hello")
        assert svc.exec(sid, "cat /root/a.txt").stdout == b"hello"
        assert svc.exec(sid, "echo ' more' >> /root/a.txt && stat -c %u /root/a.txt").stdout == b"0\n"  # owned by sandbox root
        svc.exec(sid, "mkdir -p /work/d && echo inside > /work/d/f && ln -s /work/d/f /work/link")
        assert svc.read_file(sid, "/work/link") == b"inside\n"
        assert [(e.name, e.kind) for e in svc.list_dir(sid, "/work")] == [("d", "dir"), ("link", "symlink")]
        with pytest.raises(NotFound):
            svc.read_file(sid, "/nope")
        svc.exec(sid, "mkfifo /root/fifo")
        with pytest.raises(InvalidArgument):
            svc.read_file(sid, "/root/fifo")  # a FIFO must not hang the daemon
        with pytest.raises(QuotaExceeded):
            svc.write_file(sid, "/root/big", b"\0" * (8 * 2**20))
        svc.exec(sid, "rm /root/big")
        raw = io.BytesIO()
        with tarfile.open(fileobj=raw, mode="w") as tar:
            info = tarfile.TarInfo("pkg/data.txt")
            info.size, info.uid = 4, 1234
            tar.addfile(info, io.BytesIO(b"data"))
        svc.upload_tar(sid, raw.getvalue(), "/work")
        assert svc.exec(sid, "cat /work/pkg/data.txt").stdout == b"data"
        with tarfile.open(fileobj=io.BytesIO(svc.download_tar(sid, "/work/pkg"))) as tar:
            assert tar.extractfile("./data.txt").read() == b"data"  # type: ignore[union-attr]
    finally:
        svc.destroy(sid)


def test_shell_session_keeps_state_and_survives_timeout(svc):
    sid = svc.create()
    try:
        shell = svc.open_shell(sid)
        assert svc.shell_run(shell, "cd /tmp && X=42 && f() { echo f$1; }").exit_code == 0
        r = svc.shell_run(shell, "pwd; echo $X; f 7; echo e >&2; false")
        assert (r.stdout, r.stderr, r.exit_code) == (b"/tmp\n42\nf7\n", b"e\n", 1)
        r = svc.shell_run(shell, "setsid sleep 60 & sleep 60", timeout_s=0.3)
        assert r.timed_out
        assert svc.shell_run(shell, "echo $X; pwd").stdout == b"42\n/tmp\n"
        r = svc.shell_run(shell, "while :; do :; done", timeout_s=0.3)  # a builtin loop: the session itself must go
        assert r.timed_out
        with pytest.raises(Conflict):
            svc.shell_run(shell, "true")
        svc.close_shell(shell)
    finally:
        svc.destroy(sid)


def test_stats_heartbeat_and_ttl_reaping(svc):
    sid = svc.create(ttl_s=30)
    keep = svc.create(ttl_s=3600)
    try:
        s = svc.stats(sid)
        assert s.alive and s.layer_depth == 0 and s.pids is not None and s.pids >= 2
        svc.exec(sid, "head -c 1000000 /dev/zero > /root/blob")
        assert svc.stats(sid).disk_used_bytes >= 1_000_000
        before = svc.stats(sid).expires_at
        assert svc.heartbeat(sid, ttl_s=60) > before
        assert svc.reap_expired(now=time.time() + 120) == [sid]
        assert svc.backend.sandboxes() == [keep]
    finally:
        for x in svc.backend.sandboxes():
            svc.destroy(x)


def test_init_survives_kill_all_and_is_restarted_when_killed_from_the_host(svc):
    sid = svc.create()
    try:
        init_pid = svc.backend.box(sid).init_pid
        svc.exec(sid, "echo keep > /root/k; sleep 60 & kill -9 -1", timeout_s=5)
        assert svc.exec(sid, "cat /root/k").stdout == b"keep\n"  # pid 1 of a pid namespace ignores SIGKILL from inside
        assert svc.backend.box(sid).init_pid == init_pid
        states = svc.exec(sid, "(sh -c 'sleep 0.1 &' &); sleep 0.5; ps -eo stat=").stdout.split()
        assert states and not [st for st in states if st.startswith(b"Z")], "pid 1 must reap the orphans it adopts"
        os.kill(init_pid, signal.SIGKILL)  # only the host can kill it; the next call starts a new init over the same files
        assert svc.exec(sid, "cat /root/k").stdout == b"keep\n"
        assert svc.backend.box(sid).init_pid != init_pid
    finally:
        svc.destroy(sid)


def test_base_python_runs_inside(svc):
    from openk3.sandbox.fs import rootfs

    if rootfs._python() is None:
        pytest.skip("host has no system python3 under /usr/lib/pythonX.Y to copy into the base rootfs")
    sid = svc.create()
    try:
        code = "import json, hashlib, zlib, sqlite3, ssl, ctypes, subprocess, sys; print(json.dumps([sys.prefix, 2 + 2]))"
        r = svc.exec(sid, ["python3", "-c", code])
        assert (r.exit_code, r.stdout) == (0, b'["/usr", 4]\n'), r.stderr
    finally:
        svc.destroy(sid)
