"""Escape suite, environment and privileges (issue 18 items 1, 2, 4): a caller's variables never reach a host-side process,
and no program or library from a sandbox's own tree ever runs with capabilities.

Both use a spy library: an LD_PRELOAD / ld.so.preload object whose constructor appends the process's CapEff to a log. If a
host-side hop ran with the caller's LD_PRELOAD, the host log would exist; if anything from the sandbox's tree ran with
capabilities, the sandbox log would show a non-zero CapEff.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import tempfile
import threading
import uuid

import pytest

from openk3.sandbox.linux.helper import HOST_ENV, compiler
from openk3.sandbox.namespace.instance import BASE_ENV
from openk3.sandbox.protocol import InvalidArgument

pytestmark = pytest.mark.sandbox

SPY = r"""
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
__attribute__((constructor)) static void spy(void) {
    char status[8192], exe[256];
    int fd = open("/proc/self/status", O_RDONLY);
    ssize_t n = fd < 0 ? 0 : read(fd, status, sizeof status - 1);
    if (fd >= 0) close(fd);
    status[n > 0 ? n : 0] = 0;
    ssize_t m = readlink("/proc/self/exe", exe, sizeof exe - 1);
    exe[m > 0 ? m : 0] = 0;
    char *cap = strstr(status, "CapEff:\t");
    int out = open(LOG, O_WRONLY | O_APPEND | O_CREAT, 0666);
    if (out >= 0) {
        dprintf(out, "%s %.16s\n", exe, cap ? cap + 8 : "unknown");
        close(out);
    }
}
"""


def build_spy(path: str, log: str) -> None:
    cc = compiler()
    cmd = [cc, "-shared", "-fPIC", "-O1", f'-DLOG="{log}"', "-o", path, "-x", "c", "-"]
    subprocess.run(cmd, input=SPY, text=True, check=True, capture_output=True, timeout=120)


@pytest.fixture
def host_spy():
    """(library, log) on the host, both reachable by any uid, so a hop running as the sandbox uid would log too."""
    d = tempfile.mkdtemp(prefix="openk3-spy-", dir="/tmp")
    os.chmod(d, 0o777)
    so, log = os.path.join(d, "spy.so"), os.path.join(d, "host.log")
    build_spy(so, log)
    os.chmod(so, 0o755)
    yield so, log
    shutil.rmtree(d)


def test_caller_env_never_reaches_host_side_processes(svc, host_spy):
    so, log = host_spy
    sid = svc.create(env={"LD_PRELOAD": so, "FROM_CREATE": "1"})
    try:
        box = svc.backend.box(sid)
        r = svc.exec(sid, ["/usr/bin/env"], env={"LD_PRELOAD": so, "PATH": "/nonexistent", "FROM_EXEC": "2"})
        assert r.exit_code == 0, r.stderr
        seen = dict(line.split("=", 1) for line in r.stdout.decode().splitlines())
        assert seen == {**BASE_ENV, "LD_PRELOAD": so, "PATH": "/nonexistent", "FROM_CREATE": "1", "FROM_EXEC": "2"}
        # A harmless task PATH breaks nothing: host programs are found by absolute paths, the command by the task's PATH.
        assert svc.exec(sid, "echo ok", env={"PATH": "/nonexistent"}).stdout == b"ok\n"
        assert svc.exec(sid, ["env"], env={"PATH": "/opt/task/bin:/usr/bin"}).exit_code == 0
        shell = svc.open_shell(sid, env={"LD_PRELOAD": so, "PATH": "/nonexistent"})
        assert svc.shell_run(shell, "echo $PATH").stdout == b"/nonexistent\n"
        svc.close_shell(shell)
        with open(f"/proc/{box.init_pid}/environ", "rb") as f:
            init_env = dict(kv.decode().split("=", 1) for kv in f.read().split(b"\0") if kv)
        assert init_env == {**BASE_ENV, "PWD": "/"}  # bwrap --clearenv --setenv (and its --chdir): the init runs no task code
        assert box.init is not None
        with open(f"/proc/{box.init.pid}/environ", "rb") as f:
            bwrap_env = dict(kv.decode().split("=", 1) for kv in f.read().split(b"\0") if kv)
        assert bwrap_env == HOST_ENV  # bwrap itself never sees the sandbox's variables
    finally:
        svc.destroy(sid)
    assert not os.path.exists(log), open(log).read()


def host_cmdlines() -> dict[int, bytes]:
    """Every host process's /proc/<pid>/cmdline (mode 0444: what any host user can read)."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    found[int(name)] = f.read()
            except OSError:
                continue  # exited meanwhile
    return found


def test_caller_env_is_on_no_host_command_line(svc):
    """A caller's variables, the command and its cwd travel to openk3-enter in a memfd, not on its world-readable cmdline."""
    secret, cwd = uuid.uuid4().hex, f"/root/cwd-{uuid.uuid4().hex}"
    sid = svc.create(env={"FROM_CREATE": f"create-{secret}"})
    try:
        svc.exec(sid, f"mkdir {cwd} && mkfifo /root/up /root/go")
        merged = svc.backend.box(sid).merged
        argv = ["/bin/sh", "-c", "echo up > /root/up; cat /root/go; echo $FROM_CREATE $FROM_EXEC"]
        done: list[bytes] = []
        waiting = threading.Thread(target=lambda: done.append(svc.exec(sid, argv, cwd=cwd, env={"FROM_EXEC": f"exec-{secret}"}).stdout))
        waiting.start()
        with open(f"{merged}/root/up") as f:
            f.read()  # the command runs (it opened the fifo), so its openk3-enter is alive too
        shell = svc.open_shell(sid, env={"FROM_SHELL": f"shell-{secret}"}, cwd=cwd)
        assert svc.shell_run(shell, "true").exit_code == 0  # its bash runs, so its helper finished its own exec long ago
        lines = host_cmdlines()
        enter = [line for line in lines.values() if line.startswith(svc.backend.helper.path.encode() + b"\0enter")]
        assert len(enter) == 2, lines  # the exec's helper and the shell's
        assert [pid for pid, line in lines.items() if secret.encode() in line] == []
        assert all(cwd.encode() not in line and b"echo up" not in line for line in enter)
        with open(f"{merged}/root/go", "w"):
            pass
        waiting.join()
        assert done == [f"create-{secret} exec-{secret}\n".encode()]
        assert svc.shell_run(shell, "pwd; echo $FROM_SHELL").stdout == f"{cwd}\nshell-{secret}\n".encode()
        svc.close_shell(shell)
    finally:
        svc.destroy(sid)


def test_command_spec_carries_any_argv_and_env(svc):
    """Empty words, newlines, '=' in values and ~1 MB of variables go through the memfd intact."""
    sid = svc.create()
    try:
        r = svc.exec(sid, ["printf", "[%s]", "", "a b", "x\ny", "k=v"], cwd="/tmp")
        assert (r.exit_code, r.stdout) == (0, b"[][a b][x\ny][k=v]"), r.stderr
        many = {f"V{i}": f"{i}=" + "x" * 1000 for i in range(1000)}
        r = svc.exec(sid, "env | grep -c '^V[0-9]*=[0-9]*=x'; pwd", env=many)
        assert r.stdout == b"1000\n/root\n", r.stderr
    finally:
        svc.destroy(sid)


def test_bad_variables_are_refused_with_the_field(svc):
    with pytest.raises(InvalidArgument, match=r"env\['A=B'\]"):
        svc.create(env={"A=B": "1"})
    sid = svc.create()
    try:
        for bad in ({"": "1"}, {"A": "x\0y"}, {"A=B": "1"}):
            with pytest.raises(InvalidArgument, match="env"):
                svc.exec(sid, "true", env=bad)
        with pytest.raises(InvalidArgument, match="NUL"):
            svc.exec(sid, ["echo", "a\0b"])
    finally:
        svc.destroy(sid)


def test_nothing_from_the_sandbox_tree_runs_with_capabilities(either_svc, tmp_path):
    """A sandbox plants /etc/ld.so.preload and fake `setpriv`/`env`/`nsenter`; every process that loads the spy has CapEff 0,
    also when sandboxes run as host root (sandbox_uid=None)."""
    svc = either_svc
    spy = str(tmp_path / "spy.so")
    build_spy(spy, "/root/caps.log")
    sid = svc.create()
    try:
        with open(spy, "rb") as f:
            svc.write_file(sid, "/root/spy.so", f.read(), mode=0o755)
        fake = '#!/bin/sh\ngrep CapEff /proc/self/status >> /root/fake.log\nexec "$@"\n'
        for name in ("setpriv", "env", "nsenter"):
            svc.write_file(sid, f"/usr/bin/{name}", fake.encode(), mode=0o755)
        assert svc.exec(sid, "echo /root/spy.so > /etc/ld.so.preload").exit_code == 0
        assert svc.exec(sid, "true").exit_code == 0
        assert svc.exec(sid, ["/bin/true"]).exit_code == 0
        shell = svc.open_shell(sid)
        assert svc.shell_run(shell, "cat /dev/null").exit_code == 0
        svc.close_shell(shell)
        snap = svc.snapshot(sid)
        svc.restore(sid, snap.snapshot_id)  # a new init from the planted tree
        box = svc.backend.box(sid)
        assert box.init is not None and box.init_pidfd is not None
        box.cg.kill(os.path.join(box.cg.control, "init"))  # and one started by ensure_init ...
        select.select([box.init_pidfd], [], [])  # ... once the old one is gone (cgroup.kill does not wait)
        box.init.wait()
        assert svc.exec(sid, "true").exit_code == 0
        log = svc.read_file(sid, "/root/caps.log").decode().split("\n")
        caps = [line.split()[-1] for line in log if line]
        assert len(caps) >= 6, log  # the spy ran, so the test could have failed
        assert set(caps) == {"0000000000000000"}, log
        assert svc.exec(sid, "test -e /root/fake.log").exit_code == 1  # the fakes never ran at all
        svc.delete_snapshot(snap.snapshot_id)
    finally:
        svc.destroy(sid)
