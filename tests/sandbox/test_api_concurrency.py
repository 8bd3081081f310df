"""Long execs do not hold up other calls: they run in their own pool, so create and list answer while every exec worker is
busy, and a call beyond a full pool is refused at once (503 Busy) rather than queued.

Each exec blocks on a FIFO in its sandbox that the test controls: it first writes to a second FIFO, which the test reads
from the host (that read returns only once the command is running), then waits for the test to write its gate. No timing:
every step waits for an event the previous one caused.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

import pytest

from openk3.sandbox.api.client import SandboxClient
from openk3.sandbox.api.server import create_app
from openk3.sandbox.protocol import Busy
from tests.sandbox.test_api import running

pytestmark = pytest.mark.sandbox

N = 4


def open_gate(path: str, data: bytes, timeout_s: float = 30.0) -> None:
    """Write `data` into a FIFO a command reads: opening it waits for the reader (the event), on a thread so that a command
    that never started fails the test after `timeout_s` instead of hanging it."""

    def write() -> None:
        with open(path, "wb") as f:
            f.write(data)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    writer.join(timeout_s)
    assert not writer.is_alive(), f"nobody opened {path} for reading"


def test_long_execs_do_not_block_create_or_list(svc):
    sid = svc.create(labels={"role": "gated"})
    root = svc.backend.merged_root(sid)
    svc.exec(sid, " && ".join(f"mkfifo /root/up{i} /root/gate{i}" for i in range(N + 1)))
    with running(create_app(svc, workers=1, long_workers=N, max_queue=0, reap_interval_s=None)) as url:
        clients = [SandboxClient(url) for _ in range(N + 1)]
        with concurrent.futures.ThreadPoolExecutor(N) as threads:
            execs = [threads.submit(clients[i].exec, sid, f"echo up > /root/up{i}; cat /root/gate{i}") for i in range(N)]
            for i in range(N):
                with open(os.path.join(root, f"root/up{i}")) as f:  # returns once exec i runs inside the sandbox
                    assert f.read() == "up\n"
            try:
                with pytest.raises(Busy, match="retry"):  # every long worker is taken and no queueing is allowed
                    clients[N].exec(sid, "true")
                other = clients[N].create(labels={"role": "other"})
                listed = clients[N].list_sandboxes()
                assert {sid, other} <= {s.sandbox_id for s in listed}
                assert not any(e.done() for e in execs)  # all still blocked on their gates
                clients[N].destroy(other)
            finally:
                for i in range(N):
                    open_gate(os.path.join(root, f"root/gate{i}"), f"done{i}".encode())
            assert [e.result().stdout for e in execs] == [f"done{i}".encode() for i in range(N)]
        for c in clients:
            c.close()
    svc.destroy(sid)
