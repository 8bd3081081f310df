"""`openk3 serve --replicas 1` stopped by SIGTERM to its whole process group, as a supervisor stops it: it drains, stops
the local Ray cluster it started (in a process group of its own, so the signal did not take Ray's control processes down
first) and exits 0, leaving none of its processes behind. Real processes, so bounded: the replica must report healthy
within 180 s (skipped where Ray cannot start, probed first), the exit must come within 90 s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve", reason="ray[serve] is not installed (the `ray` extra)")

from tests.scale.test_ray_replicas import ARGV, _free_port, ray_can_start  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def descendants(root: int) -> set[int]:
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found: set[int] = set()
    todo = [root]
    while todo:
        p = todo.pop()
        children = {c for c, pp in parent.items() if pp == p} - found
        found |= children
        todo += children
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_sigterm_to_the_process_group_drains_stops_ray_and_exits_0() -> None:
    reason = ray_can_start(90)
    if reason is not None:
        pytest.skip(reason)
    port = _free_port()
    argv = [sys.executable, "-m", "openk3", "serve", *ARGV, "--replicas", "1", "--host", "127.0.0.1", "--port", str(port)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    server = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    family: set[int] = set()
    try:
        deadline = time.monotonic() + 180
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            while True:
                assert server.poll() is None, f"openk3 serve exited with {server.returncode} before it served"
                try:
                    if client.get("/health", timeout=10).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, "the replica did not report healthy within 180 s"
                time.sleep(1)
        family = descendants(server.pid)
        assert family, "a local Ray cluster runs under the server"
        os.killpg(server.pid, signal.SIGTERM)
        assert server.wait(90) == 0
        left = time.monotonic() + 30  # the cluster's own processes end after their `ray start` (a bound, not a race)
        while any(alive(pid) for pid in family):
            assert time.monotonic() < left, f"processes of the server's Ray cluster still alive 30 s after it exited: {sorted(family)}"
            time.sleep(0.5)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        for pid in family:  # whatever of this test's cluster is left
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
