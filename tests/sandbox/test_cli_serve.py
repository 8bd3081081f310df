"""`openk3 sandbox serve` as a real process: it answers, and SIGTERM leaves no sandboxes, mounts or cgroups behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

from openk3.sandbox.linux import syscalls
from openk3.sandbox.namespace.recovery import cgroup_prefix, state_mounts
from tests.sandbox.conftest import sandbox_uid

pytestmark = pytest.mark.sandbox

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVE = """
import argparse, sys
from openk3.sandbox import cli
parser = argparse.ArgumentParser(prog="openk3")
cli.register(parser.add_subparsers(dest="command"))
args = parser.parse_args(sys.argv[1:])
sys.exit(args.func(args))
"""


def cgroup_roots(layout) -> set[str]:
    return {r for r in (layout.control_root, *layout.v1_roots.values()) if r}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen[bytes], port: int) -> None:
    """Until /v1/health answers; fails with the daemon's output if it exits or takes a minute."""
    deadline = time.monotonic() + 60
    while True:
        try:
            assert httpx.get(f"http://127.0.0.1:{port}/v1/health").json()["ok"]
            return
        except httpx.TransportError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise AssertionError(proc.communicate()[0].decode(errors="replace")) from None
            time.sleep(0.2)


def test_serve_then_sigterm_cleans_up(host_features):
    uid = str(sandbox_uid())
    state = tempfile.mkdtemp(prefix="openk3-sandbox-serve-", dir="/tmp")
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            SERVE,
            "sandbox",
            "serve",
            "--port",
            str(port),
            "--state-dir",
            state,
            "--store-bytes",
            str(256 * 2**20),
            "--workers",
            "2",
            "--sandbox-uid",
            uid,
        ],
        env={**os.environ, "PYTHONPATH": ROOT},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_healthy(proc, port)
        sid = httpx.post(f"http://127.0.0.1:{port}/v1/create", json={}).json()["result"]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/exec", json={"sandbox_id": sid, "cmd": "echo hi"}).json()["result"]
        assert r["stdout"] == {"b64": "aGkK"}  # base64 of b"hi\n"
        assert syscalls.mounts_under(state)
        instance = state_mounts()[os.path.realpath(state)]
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out
    assert syscalls.mounts_under(state) == [] and not os.path.exists(state)
    mine = cgroup_prefix(instance)
    assert not [r for r in cgroup_roots(host_features.layout) if os.path.exists(os.path.join(r, mine))]
