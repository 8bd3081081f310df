"""Terminal sessions through the real sync and async clients: a shell on a pty of the sandbox's own devpts, typed into,
resized, interrupted and read by offset or as a stream, with bounded output.

Each test waits for output the terminal shows (`read_until`, or a stream) with generous deadlines, never for a fixed time.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from openk3.sandbox.api.client import AsyncSandboxClient
from openk3.sandbox.protocol import Conflict, InvalidArgument, NotFound
from tests.sandbox.test_api_streams import api as api  # noqa: F401 (the fixture: a sandbox with a gate, the service and a client)
from tests.sandbox.test_api_streams import only_init_left, until

pytestmark = pytest.mark.sandbox
SHELL = ["/bin/bash", "--norc", "--noprofile", "-i"]


def read_until(client, pty_id: str, offset: int, marker: bytes, timeout_s: float = 30.0) -> tuple[bytes, int]:
    """Output from `offset` up to and including the first `marker`, and the offset after what was read."""
    deadline, out = time.monotonic() + timeout_s, b""
    while marker not in out:
        left = deadline - time.monotonic()
        assert left > 0, f"timed out waiting for {marker!r}; the terminal showed {out!r}"
        got = client.pty_read(pty_id, offset, timeout_s=min(left, 5.0))
        assert got.skipped == 0
        out, offset = out + got.data, got.offset
        assert got.more or marker in out, f"the terminal ended before {marker!r}: {out!r}"
    return out, offset


def test_a_shell_on_the_sandboxes_own_terminal_resizes_and_exits(api):
    svc, client, _url, sid, _root = api
    pty = client.pty_create(sid, SHELL, rows=30, cols=100)
    # Echoed input is not the answer: the markers are built by the shell (a$((1))), so only its output contains them.
    client.pty_write(pty, b"tty; stty size; echo $TERM; echo m$((1))\n")
    out, at = read_until(client, pty, 0, b"m1")
    assert b"/dev/pts/0\r\n30 100\r\nxterm-256color\r\n" in out
    # The daemon holds only the master, and it is of another devpts instance than the host's /dev/pts.
    master = svc.terminals.table.get(pty).terminal.master
    assert os.fstat(master).st_dev != os.stat("/dev/pts/ptmx").st_dev
    client.pty_resize(pty, 50, 132)
    client.pty_write(pty, b"stty size; echo m$((2))\n")
    out, at = read_until(client, pty, at, b"m2")
    assert b"50 132\r\n" in out and (client.pty_status(pty).rows, client.pty_status(pty).cols) == (50, 132)
    client.pty_write(pty, b"exit 3\n")
    done = client.pty_wait(pty, timeout_s=30)
    assert (done.running, done.exit_code, done.killed, done.error) == (False, 3, False, None)
    assert client.pty_read(pty, done.output_bytes).more is False  # the end is known to every reader
    with pytest.raises(Conflict, match="ended"):
        client.pty_write(pty, b"late\n")
    until(lambda: only_init_left(svc, sid), "the shell's processes to be gone")


def test_ctrl_c_interrupts_the_foreground_job_and_kill_ends_the_session(api):
    svc, client, _url, sid, _root = api
    pty = client.pty_create(sid, SHELL)
    client.pty_write(pty, b"sleep 600\n")
    until(lambda: client.exec(sid, "grep -lx sleep /proc/[0-9]*/comm").exit_code == 0, "sleep to be the foreground job")
    client.pty_write(pty, b"\x03")  # the terminal's line discipline turns it into SIGINT for the foreground group
    client.pty_write(pty, b"echo after-$?\n")  # bash ends a whole command line on an interrupt: the check is a line of its own
    read_until(client, pty, 0, b"after-130")
    assert client.pty_status(pty).running  # the shell survived its job's interrupt

    client.pty_write(pty, b"setsid sleep 600 & sleep 600\n")  # a background job left in its own session, and a foreground one
    until(lambda: len(client.exec(sid, "grep -lx sleep /proc/[0-9]*/comm").stdout.split()) == 2, "both sleeps to run")
    killed = client.pty_kill(pty)
    assert killed.killed and not killed.running
    until(lambda: only_init_left(svc, sid), "everything the terminal started to be killed")


def test_output_is_kept_in_a_bounded_ring_with_offsets(api):
    _svc, client, _url, sid, _root = api
    pty = client.pty_create(sid, "seq 1 30000; echo END", max_buffer_bytes=4096)
    done = client.pty_wait(pty, timeout_s=60)
    assert done.exit_code == 0 and done.output_bytes > 150_000  # "seq" wrote far more than the ring keeps
    got = client.pty_read(pty, 0)
    assert got.skipped == done.output_bytes - 4096 and len(got.data) == 4096 and got.data.endswith(b"END\r\n")
    assert got.offset == done.output_bytes and not got.more
    tail = client.pty_read(pty, done.output_bytes - 5, max_bytes=3)
    assert (tail.data, tail.offset, tail.skipped, tail.more) == (b"END", done.output_bytes - 2, 0, True)
    streamed = list(client.pty_stream(pty, max_bytes=1000))  # the sync stream of an ended terminal: what was kept, then the end
    assert b"".join(i.data for i in streamed) == got.data and streamed[0].skipped == got.skipped and not streamed[-1].more
    with pytest.raises(NotFound):
        next(client.pty_stream("pty-nope"))  # refused before the stream starts, as a 4xx answer


def test_refusals_name_the_argument(api):
    svc, client, _url, sid, _root = api
    for kwargs, match in (
        ({"rows": 0}, "rows"),
        ({"cols": 5000}, "cols"),
        ({"max_buffer_bytes": 1 << 30}, "max_buffer_bytes"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"cmd": []}, "cmd"),
        ({"env": {"A=B": "x"}}, "env"),
    ):
        with pytest.raises(InvalidArgument, match=match):
            client.pty_create(sid, **kwargs)
    with pytest.raises(NotFound):
        client.pty_create("sb-nope@h")
    pty = client.pty_create(sid, "exec sleep 600")
    with pytest.raises(InvalidArgument, match="offset"):
        client.pty_read(pty, 10**9)
    with pytest.raises(InvalidArgument, match="at most"):
        client.pty_write(pty, b"x" * ((1 << 20) + 1))
    with pytest.raises(InvalidArgument, match="rows"):
        client.pty_resize(pty, 1, 0)
    with pytest.raises(NotFound):
        client.pty_read("pty-nope")
    svc.destroy(sid)  # a destroy ends the session and forgets it
    with pytest.raises(NotFound):
        client.pty_status(pty)


def test_async_client_streams_the_output_while_typing(api):
    _svc, _client, url, sid, _root = api

    async def scenario() -> tuple[bytes, list[bool]]:
        async with AsyncSandboxClient(url) as client:
            pty = await client.pty_create(sid, "echo ready-$((7*6)); read x; echo got-$x", rows=10, cols=40)
            seen, mores, typed = b"", [], False
            async for item in client.pty_stream(pty):
                seen += item.data
                mores.append(item.more)
                if b"ready-42" in seen and not typed:  # the command waits for this line while the stream stays open
                    await client.pty_write(pty, b"yes\r")
                    typed = True
            return seen, mores

    seen, mores = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert b"got-yes\r\n" in seen and mores[-1] is False and all(mores[:-1])
