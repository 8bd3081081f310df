"""Escape suite, process groups and terminals: a sandbox command shares neither the daemon's process group nor its session.

`kill 0` signals the caller's whole process group, across pid namespaces: if sandbox commands were in the daemon's group,
`kill -KILL 0` in one sandbox would kill other sandboxes' bwrap (same host uid) or, with sandbox_uid=None, the daemon itself.
And a command in the daemon's session could open the daemon's controlling terminal as /dev/tty and push keystrokes into the
operator's shell (TIOCSTI). The daemon runs here in a child process whose controlling terminal is a fresh pty, as when an
operator starts it from a shell, so a wrong answer kills only that child (whose leftovers the next daemon on its state dir
removes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from openk3.sandbox.namespace.backend import NamespaceBackend
from openk3.sandbox.namespace.settings import BackendConfig

pytestmark = pytest.mark.sandbox

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DAEMON = r"""
import json, os, sys, threading
tty, state, cache, uid, report_path = sys.argv[1:]
os.login_tty(os.open(tty, os.O_RDWR))  # a new session whose controlling terminal is the pty, like a daemon started in a shell
log = os.open(report_path + ".log", os.O_WRONLY | os.O_CREAT, 0o600)
os.dup2(log, 1)
os.dup2(log, 2)
from openk3.sandbox.api.service import SandboxService
from openk3.sandbox.namespace.settings import BackendConfig
config = BackendConfig(state_dir=state, cache_dir=cache, store_bytes=256 << 20, sandbox_uid=None if uid == "-" else int(uid), prewarm=False)
svc = SandboxService(config)
report = {}


def step(name, fn):
    try:
        report[name] = fn()
    except Exception as e:  # recorded, so the test names the step that broke
        report[name] = f"error: {e}"


try:
    a, b = svc.create(), svc.create()
    svc.exec(b, "nohup sleep 300 >/dev/null 2>&1 &")
    box_b = svc.backend.box(b)
    b_before = sorted(box_b.cg.pids())
    shell = svc.open_shell(a)
    # While an exec waits on a fifo, every process of both sandboxes (bwraps, inits, helpers, commands) is counted.
    svc.exec(a, "mkfifo /root/up /root/go")
    waiting = threading.Thread(target=svc.exec, args=(a, "echo up > /root/up; cat /root/go"))
    waiting.start()
    merged = svc.backend.box(a).merged
    with open(merged + "/root/up") as f:
        f.read()
    everything = [*svc.backend.box(a).cg.pids(), *b_before]
    step("own sessions", lambda: all(os.getsid(p) != os.getsid(0) for p in everything))
    with open(merged + "/root/go", "w"):
        pass
    waiting.join()
    step("exec tty", lambda: svc.exec(a, "true </dev/tty && echo opened", timeout_s=30).stderr.decode())
    step("shell tty", lambda: svc.shell_run(shell, "true </dev/tty && echo opened", timeout_s=30).stderr.decode())
    trapped = "trap 'echo caught' TERM; kill -TERM 0; echo after"
    step("exec trap", lambda: (lambda r: [r.exit_code, r.stdout.decode()])(svc.exec(a, trapped, timeout_s=30)))
    for sig in ("TERM", "KILL"):
        step(f"exec kill -{sig} 0", lambda: svc.exec(a, f"kill -{sig} 0", timeout_s=30).exit_code)
    step("shell kill -KILL 0", lambda: svc.shell_run(shell, "kill -KILL 0", timeout_s=30).exit_code)
    svc.close_shell(shell)
    step("b untouched", lambda: sorted(box_b.cg.pids()) == b_before and box_b.alive())
    step("a usable", lambda: svc.exec(a, "echo ok", timeout_s=30).stdout.decode())
finally:
    with open(report_path, "w") as f:
        json.dump(report, f)
    svc.close()
"""


@pytest.mark.parametrize("as_root", [False, True], ids=["sandbox_uid=100000", "sandbox_uid=None"])
def test_kill_0_and_dev_tty_stay_inside(service, as_root):
    cache = service.backend.config.cache_dir
    uid = "-" if as_root else str(service.backend.config.sandbox_uid)
    state = tempfile.mkdtemp(prefix="openk3-sandbox-tty-", dir="/tmp")
    report_path = os.path.join(tempfile.mkdtemp(prefix="openk3-tty-report-"), "report.json")
    master, slave = os.openpty()
    try:
        daemon = subprocess.run(
            [sys.executable, "-c", DAEMON, os.ttyname(slave), state, cache, uid, report_path], cwd=REPO, timeout=300, check=False, stdin=subprocess.DEVNULL
        )
        log = open(report_path + ".log").read() if os.path.exists(report_path + ".log") else ""
        assert daemon.returncode == 0, f"the daemon died (status {daemon.returncode}): {log[-2000:]}"
        with open(report_path) as f:
            report = json.load(f)
    finally:
        os.close(slave)
        os.close(master)
        if os.path.exists(state):  # the daemon was killed: the next one on its state dir removes what it left
            NamespaceBackend(BackendConfig(state_dir=state, cache_dir=cache, sandbox_uid=None if uid == "-" else int(uid))).close()
    assert report["own sessions"] is True, f"a sandbox process (bwrap, openk3-enter or a command) is in the daemon's session: {report}"
    assert "No such device or address" in report["exec tty"] and "No such device or address" in report["shell tty"], report
    # The command's group is its own: its helper (outside the sandbox) did not get the signal, so its exit status is the command's.
    assert report["exec trap"] == [0, "caught\nafter\n"], report
    # Each kill ended only its own command: 143/137 for the exec (killed by its signal), 137 for the shell's bash.
    assert (report["exec kill -TERM 0"], report["exec kill -KILL 0"], report["shell kill -KILL 0"]) == (143, 137, 137), report
    assert report["b untouched"] is True, f"kill 0 in sandbox a reached sandbox b: {report}"
    assert report["a usable"] == "ok\n", report
