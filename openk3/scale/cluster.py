"""Joining a Ray cluster, or starting a local one, with errors that say which.

`ray.init` runs in the caller's (main) thread: started from another thread, Ray cannot install its signal handlers and
its driver fails to reach the GCS it just started. Its wait for the GCS is Ray's own bound (60 s), after which Ray ends
the process with its message; an error Ray raises instead becomes a RayStartError naming the cluster. A local cluster is
started with the dashboard off (not needed, and the slowest part to start).

`LocalCluster` is the local cluster of `openk3 serve --replicas N`: `ray start --head --block` in a session of its own,
so a signal to the server's process group (an operator's `kill -TERM -PGID`, a supervisor stopping the group) reaches
the server and not Ray's control processes: the server then drains its replicas and stops the cluster itself, in that
order. `ray.init()` would start them in the server's own group, where the same signal takes the GCS down first and the
server's shutdown then waits on it. The cluster shares the server's fate: `ray start` gets SIGTERM when the server's
process dies, however it dies (Linux's parent-death signal), and stops its processes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ray
from ray._private.authentication.authentication_token_setup import enable_token_auth_by_default

PR_SET_PDEATHSIG = 1


class RayStartError(RuntimeError):
    pass


def connect(address: str | None, num_cpus: int | None = None) -> None:
    if ray.is_initialized():
        return
    where = "a local Ray cluster" if address is None else f"the Ray cluster at {address}"
    try:
        if address is None:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    except Exception as e:
        raise RayStartError(f"{where} could not be started: {e}") from e


def _own_session_dying_with_parent() -> None:
    """preexec_fn of `ray start`: a session (and process group) of its own, and SIGTERM when its parent dies."""
    os.setsid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalCluster:
    """A local Ray head in its own process group; `close()` stops it (SIGTERM, then SIGKILL of its group past a bound)."""

    def __init__(self, process: subprocess.Popen[bytes], address: str, log: Path) -> None:
        self.process, self.address, self.log = process, address, log  # log: what `ray start` printed

    @classmethod
    def start(cls, num_cpus: int | None = None, bound_s: float = 60.0) -> LocalCluster:
        """`ray start --head --block` on a free port; returns once `ray start` has written that the head runs (it then
        blocks), or raises RayStartError with its last output after `bound_s` or when it exits. Its output goes to
        `log`, in the cluster's temp dir."""
        port = _free_port()
        # a temp dir of its own: `ray start` records its address in the temp dir, where any later `ray.init()` on this
        # machine would find it and join this cluster instead of starting its own
        temp_dir = tempfile.mkdtemp(prefix="openk3-ray-")
        argv = [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--include-dashboard=false",
            f"--temp-dir={temp_dir}",
        ]
        if num_cpus is not None:
            argv.append(f"--num-cpus={num_cpus}")
        # Ray's token authentication, as a local ray.init() has it: on unless RAY_AUTH_MODE says otherwise, for this
        # driver (which would otherwise join without its token) and, through the environment, for the cluster
        enable_token_auth_by_default()
        log = Path(temp_dir) / "ray-start.log"  # beside Ray's own session logs, kept as Ray keeps those
        with log.open("wb") as out:  # `ray start` writes it for its whole life; nothing here has to drain it
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_own_session_dying_with_parent)
        cluster, deadline = cls(process, f"127.0.0.1:{port}", log), time.monotonic() + bound_s
        while True:
            text = cluster.log.read_text(errors="replace")
            if "block forever" in text:  # `ray start --block` printed its last start-up line: the head runs
                return cluster
            if process.poll() is not None or time.monotonic() > deadline:
                cluster.close()
                why = f"exited with code {process.returncode}" if process.returncode is not None else f"did not start within {bound_s:g} s"
                tail = " | ".join(text.strip().splitlines()[-3:]) or "no output"
                raise RayStartError(f"a local Ray cluster (ray start --head) {why} (its output: {cluster.log}): {tail}")
            time.sleep(0.1)

    def close(self, bound_s: float = 20.0) -> int | None:
        """Stop the cluster; its `ray start` exit code (None: it had to be killed with its group)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(bound_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)  # its session's leftovers (the group outlives `ray start` itself)
        except ProcessLookupError:
            pass
        if self.process.poll() is None:
            self.process.wait()
            return None
        return self.process.returncode
