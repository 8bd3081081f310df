"""The HTTP server and both clients on 127.0.0.1: the same calls as the Python API, and clear errors."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from openk3.sandbox.api.client import AsyncSandboxClient, SandboxClient
from openk3.sandbox.api.server import create_app
from openk3.sandbox.protocol import InvalidArgument, Limits, NotFound, SandboxError

pytestmark = pytest.mark.sandbox


@contextlib.contextmanager
def running(app):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture
def base_url(svc):
    with running(create_app(svc, workers=4, reap_interval_s=None)) as url:
        yield url


def test_sync_client_round_trip(base_url):
    with SandboxClient(base_url) as c:
        sid = c.create(limits=Limits(memory_bytes=128 * 2**20), env={"A": "1"})
        try:
            r = c.exec(sid, "echo $A; cat", stdin=b"\x00\xffbin")
            assert r.stdout == b"1\n\x00\xffbin" and r.exit_code == 0
            c.write_file(sid, "/root/x", b"\x01\x02")
            assert c.read_file(sid, "/root/x") == b"\x01\x02"
            assert "x" in [e.name for e in c.list_dir(sid, "/root")]
            snap = c.snapshot(sid)
            c.exec(sid, "rm /root/x")
            c.restore(sid, snap.snapshot_id)
            assert c.read_file(sid, "/root/x") == b"\x01\x02"
            (child,) = c.fork(snap.snapshot_id, 1)
            assert c.stats(child).layer_depth == 1
            c.destroy(child)
            shell = c.open_shell(sid)
            c.shell_run(shell, "cd /tmp")
            assert c.shell_run(shell, "pwd").stdout == b"/tmp\n"
            c.close_shell(shell)
            c.delete_snapshot(snap.snapshot_id)
        finally:
            c.destroy(sid)
        with pytest.raises(NotFound, match="sb-nope"):
            c.exec("sb-nope@x", "true")
        with pytest.raises(InvalidArgument, match="timeout_s"):
            c.exec("sb-nope@x", "true", timeout_s="soon")  # type: ignore[arg-type]
    r = httpx.post(f"{base_url}/v1/no_such_method", json={})
    assert r.status_code == 404 and "no_such_method" in r.json()["error"]["message"]
    r = httpx.post(f"{base_url}/v1/create", content=b"not json")
    assert r.status_code == 400
    r = httpx.post(f"{base_url}/v1/create", json={"limits": {"memory_bytes": 1}})  # the server validates, not the client
    assert r.status_code == 400 and "memory_bytes=1" in r.json()["error"]["message"]
    r = httpx.post(f"{base_url}/v1/create", json={"limitz": {}})
    assert r.status_code == 400 and "limitz" in r.json()["error"]["message"]
    with pytest.raises(SandboxError, match="cannot reach"):
        SandboxClient("http://127.0.0.1:9").stats("sb-x@y")


def test_async_client_parallel(base_url):
    async def main() -> None:
        async with AsyncSandboxClient(base_url, max_connections=4) as c:
            sids = await asyncio.gather(*(c.create() for _ in range(3)))
            try:
                results = await asyncio.gather(*(c.exec(s, f"echo {i}") for i, s in enumerate(sids)))
                assert [r.stdout for r in results] == [b"0\n", b"1\n", b"2\n"]
                eid = await c.create_env("demo")
                await c.call_env(eid, "step", [2])
                snap = await c.snapshot(eid, kind="process")
                (copy,) = await c.fork(snap.snapshot_id, 1)
                assert (await c.call_env(copy, "state"))["steps"] == 1
                for x in (copy, eid):
                    await c.destroy(x)
                await c.delete_snapshot(snap.snapshot_id)
            finally:
                await asyncio.gather(*(c.destroy(s) for s in sids))

    asyncio.run(main())
