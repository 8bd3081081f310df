"""Output while a command runs (exec_stream), background processes with a handle, labels, and raw bytes on the wire.

Commands wait on FIFOs the test writes (see test_api_concurrency.py), so "while it runs" is an event, not a timing guess.
Where the daemon reads output on its own thread, the test waits for a condition with a generous deadline (`until`).
"""

from __future__ import annotations

import base64
import json
import os
import time

import httpx
import pytest

from openk3.sandbox.api.client import SandboxClient
from openk3.sandbox.api.server import create_app
from openk3.sandbox.protocol import ExecResult, InvalidArgument, NotFound, OutputChunk
from tests.sandbox.test_api import running
from tests.sandbox.test_api_concurrency import open_gate

pytestmark = pytest.mark.sandbox


def until(condition, what: str, timeout_s: float = 30.0):
    """The first true value of `condition()`; fails naming `what` if none comes within the (hang-guard) timeout."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return value


def only_init_left(svc, sid: str) -> bool:
    """No process of the sandbox but its init (bwrap and its pid 1, in the `init` leaf)."""
    cg = svc.backend.box(sid).cg
    return set(cg.pids()) == set(cg.pids(os.path.join(cg.control, "init")))


@pytest.fixture
def api(svc):
    with running(create_app(svc, workers=2, reap_interval_s=None)) as url, SandboxClient(url) as client:
        sid = svc.create()
        svc.exec(sid, "mkfifo /root/gate /root/gate2")
        yield svc, client, url, sid, os.path.join(svc.backend.merged_root(sid), "root")
        if sid in svc.backend.sandboxes():  # a test may destroy it itself
            svc.destroy(sid)


def test_exec_stream_yields_output_while_the_command_runs(api):
    svc, client, _url, sid, root = api
    stream = client.exec_stream(sid, "echo first; cat /root/gate >/dev/null; echo second >&2; exit 3")
    assert next(stream) == OutputChunk("stdout", b"first\n")  # the command is still blocked on its gate here
    open_gate(os.path.join(root, "gate"), b"go")
    rest = list(stream)
    assert rest[:-1] == [OutputChunk("stderr", b"second\n")]
    result = rest[-1]
    assert isinstance(result, ExecResult) and result.exit_code == 3 and result.stdout == b"" and not result.timed_out


def test_exec_stream_refusals_and_early_close(api):
    svc, client, url, sid, root = api
    with pytest.raises(NotFound, match="sb-nope"):
        next(client.exec_stream("sb-nope@h", "true"))
    with pytest.raises(InvalidArgument, match="timeout_s"):
        next(client.exec_stream(sid, "true", timeout_s=0))
    r = httpx.post(f"{url}/v1/exec_stream", json={"sandbox_id": sid, "cmd": "true", "bogus": 1})
    assert r.status_code == 400 and "bogus" in r.json()["error"]["message"]
    stream = client.exec_stream(sid, "echo hi; cat /root/gate")
    assert next(stream) == OutputChunk("stdout", b"hi\n")
    stream.close()  # the caller went away: the daemon kills the command instead of leaving it blocked
    until(lambda: only_init_left(svc, sid), "the abandoned command to be killed")
    assert client.exec(sid, "echo after").stdout == b"after\n"


def test_background_process_status_output_and_kill(api):
    svc, client, _url, sid, root = api
    pid = client.spawn(sid, "echo out1; echo err1 >&2; cat /root/gate >/dev/null; echo out2")
    assert client.process_status(pid).running
    got = until(lambda: (o := client.process_output(pid)).stdout == b"out1\n" and o.stderr == b"err1\n" and o, "the first output")
    assert got.running and (got.stdout_offset, got.stderr_offset) == (5, 5)
    open_gate(os.path.join(root, "gate"), b"go")
    done = client.process_wait(pid, timeout_s=30)
    assert not done.running and done.exit_code == 0 and not done.killed and done.stdout_bytes == 10
    later = client.process_output(pid, got.stdout_offset, got.stderr_offset)
    assert (later.stdout, later.stderr, later.running) == (b"out2\n", b"", False)  # only what came after the offsets

    pid2 = client.spawn(sid, "setsid sleep 600 & echo started; cat /root/gate2")
    until(lambda: client.process_output(pid2).stdout == b"started\n", "the second process to start")
    killed = client.process_kill(pid2)
    assert killed.killed and not killed.running and killed.error is None
    until(lambda: only_init_left(svc, sid), "the killed tree (setsid child included) to be gone")
    with pytest.raises(InvalidArgument, match="timeout_s"):
        client.spawn(sid, "true", timeout_s=-1)
    with pytest.raises(InvalidArgument, match="max_output_bytes"):
        client.spawn(sid, "true", max_output_bytes=1 << 40)
    svc.destroy(sid)
    with pytest.raises(NotFound):
        client.process_status(pid)


def test_labels_filter_list_sandboxes(api):
    svc, client, _url, sid, _root = api
    a = client.create(labels={"task": "t1", "group": "g"})
    b = client.create(labels={"task": "t2", "group": "g"})
    try:
        assert [s.sandbox_id for s in client.list_sandboxes(labels={"group": "g"})] == [a, b]
        (only,) = client.list_sandboxes(labels={"task": "t2"})
        assert only.sandbox_id == b and only.labels == {"task": "t2", "group": "g"} and only.image is None
        assert client.list_sandboxes(labels={"task": "t3"}) == []
        assert sid in [s.sandbox_id for s in client.list_sandboxes()]
        snap = client.snapshot(a)
        (child,) = client.fork(a, 1)  # a fork of a sandbox keeps its labels
        assert client.list_sandboxes(labels={"task": "t1"})[-1].sandbox_id == child
        client.destroy(child)
        client.delete_snapshot(snap.snapshot_id)
        with pytest.raises(InvalidArgument, match="labels"):
            client.create(labels={"bad key!": "x"})
    finally:
        client.destroy(a)
        client.destroy(b)


def test_bytes_travel_raw_or_base64(api):
    _svc, client, url, sid, _root = api
    data = bytes(range(256)) * 256
    client.write_file(sid, "/root/blob", data)
    r = httpx.post(f"{url}/v1/read_file", json={"sandbox_id": sid, "path": "/root/blob"})
    assert r.headers["content-type"] == "application/octet-stream" and r.content == data
    assert client.read_file(sid, "/root/blob") == data
    r = httpx.post(f"{url}/v1/exec", json={"sandbox_id": sid, "cmd": "cat /root/blob"})
    assert base64.b64decode(r.json()["result"]["stdout"]["b64"]) == data
    assert len(r.content) < 1.4 * len(data)  # base64 is 4/3; latin-1 in JSON was 4-6x for such bytes
    r = httpx.post(f"{url}/v1/write_file", params={"args": json.dumps({"sandbox_id": sid, "path": "/root/x", "moed": 1})}, content=b"x")
    assert r.status_code == 400 and "moed" in r.json()["error"]["message"]
