"""An init that misbehaves while it starts (namespace/startup.py): after a restore it is the sandbox's own /bin/bash, so it may
print without end, print nothing and block, or exit; the daemon reads it under a byte cap and a deadline, kills the sandbox's
processes and reports why, and keeps the sandbox as it was."""

from __future__ import annotations

import fcntl
import os
import subprocess
import tempfile
import threading

import pytest

from openk3.sandbox.namespace.settings import BackendConfig
from openk3.sandbox.namespace.startup import MAX_OUTPUT_BYTES, StartupError, pin, wait_ready
from openk3.sandbox.protocol import SandboxError
from tests.sandbox.conftest import checked, started


def pipes(out: bytes, info: bytes, close: bool) -> tuple[int, int, list[int]]:
    """(out read end, info read end, write ends still open) with `out` and `info` already written."""
    out_r, out_w = os.pipe()
    info_r, info_w = os.pipe()
    fcntl.fcntl(out_w, fcntl.F_SETPIPE_SZ, 1 << 20)  # room for the flood case in one write
    os.write(out_w, out)
    os.write(info_w, info)
    held = [out_w, info_w]
    if close:
        for fd in held:
            os.close(fd)
        held = []
    return out_r, info_r, held


@pytest.mark.parametrize(
    ("out", "info", "close", "error"),
    [
        (b"ld.so: noise\nmore\nready\n", b'{"child-pid": 4242}', True, None),
        (b"ready\n", b'{"child-pid": 4242}', False, "did not say ready within 0.05 s"),  # bwrap's info pipe never ends
        (b"", b"", False, "did not say ready within 0.05 s"),
        (b"x" * (MAX_OUTPUT_BYTES + 1), b"", False, f"more than {MAX_OUTPUT_BYTES} bytes"),
        (b"no ready here\n", b'{"child-pid": 4242}', True, "exited before it was ready"),
        (b"ready\n", b"not json", True, "no child pid"),
    ],
    ids=["noise-then-ready", "info-open", "silent", "flood", "exits", "bad-info"],
)
def test_wait_ready_is_bounded(out, info, close, error):
    out_r, info_r, held = pipes(out, info, close)
    try:
        if error is None:
            assert wait_ready(out_r, info_r, 5.0) == 4242
        else:
            with pytest.raises(StartupError, match=error):
                wait_ready(out_r, info_r, 0.05)
    finally:
        for fd in (out_r, info_r, *held):
            os.close(fd)


def test_pin_checks_the_parent():
    child = subprocess.Popen(["sleep", "300"])
    try:
        with pytest.raises(StartupError, match="not bwrap 1's child"):
            pin(child.pid, 1)
        pidfd = pin(child.pid, os.getpid())
        os.close(pidfd)
    finally:
        child.kill()
        child.wait()
    with pytest.raises(StartupError, match="exited"):
        pin(child.pid, os.getpid())


@pytest.fixture(scope="module")
def quick_service(service):
    """A daemon that gives an init one second (instead of ten) to come up, and builds no standbys."""
    config = BackendConfig(
        state_dir=tempfile.mkdtemp(prefix="openk3-sandbox-init-", dir="/tmp"),
        cache_dir=service.backend.config.cache_dir,
        store_bytes=256 * 2**20,
        sandbox_uid=service.backend.config.sandbox_uid,
        init_timeout_s=1.0,
        prewarm=False,
    )
    yield from started(config)


@pytest.fixture
def quick(quick_service):
    yield from checked(quick_service)


PLANTED = {
    # prints a MiB without a newline, then blocks
    "flood": (f"head -c {1 << 20} /dev/zero | tr '\\0' x\nexec cat /root/never\n", f"more than {MAX_OUTPUT_BYTES} bytes"),
    "silent": ("exec cat /root/never\n", "did not say ready within 1 s"),  # a FIFO nobody writes: blocks forever
    "exits": ("echo planted; exit 3\n", "exited before it was ready: 'planted'"),
    "noisy": ('echo planted noise; echo more >&2; exec /usr/bin/bash.real "$@"\n', None),  # then starts as usual
    # takes 70 ptys before the daemon caps /dev/pts at 64 (linux/ptys.py), keeps them open and starts as usual
    "ptys": (
        "exec python3 -c 'import os, sys\n"
        'for _ in range(70): os.set_inheritable(os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY), True)\n'
        'os.execv("/usr/bin/bash.real", ["bash", *sys.argv[1:]])\' "$@"\n',
        f"opened ptys [64, 65, 66, 67, 68, 69] before they were capped at sandbox_ptys={BackendConfig.sandbox_ptys}",
    ),
}


@pytest.mark.sandbox
@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_planted_init_fails_cleanly(quick, kind):
    script, error = PLANTED[kind]
    sid = quick.create()
    snap = None
    try:
        quick.write_file(sid, "/root/planted", f"#!/bin/sh\n{script}".encode(), mode=0o755)
        # a rename, not a write: the running init has the real bash open for execution
        assert quick.exec(sid, "mkfifo /root/never && cp /usr/bin/bash /usr/bin/bash.real && mv /root/planted /usr/bin/bash").exit_code == 0
        snap = quick.snapshot(sid)
        old = quick.backend.box(sid)
        outcome: list[BaseException | None] = []

        def restore() -> None:
            try:
                quick.restore(sid, snap.snapshot_id)
                outcome.append(None)
            except BaseException as e:
                outcome.append(e)

        worker = threading.Thread(target=restore, daemon=True)
        worker.start()
        worker.join(120)  # only a daemon without the deadline would get here with the restore still running
        assert outcome, "restore hung on the planted init"
        if error is None:
            assert outcome == [None] and quick.exec(sid, "echo ok").stdout == b"ok\n"
            return
        assert isinstance(outcome[0], SandboxError) and error in str(outcome[0]), outcome
        # The sandbox is as it was; the leak check after the test shows that the failed instance left nothing behind.
        assert quick.backend.box(sid) is old and quick.exec(sid, "echo still").stdout == b"still\n"
    finally:
        quick.destroy(sid)
        if snap is not None:
            quick.delete_snapshot(snap.snapshot_id)
