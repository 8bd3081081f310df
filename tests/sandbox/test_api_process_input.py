"""Stdin and signals of background processes, through the real sync client: reached by the process handle only.

Every wait is for an event the sandbox shows (output read, a process gone) with a generous deadline (`until`), not a sleep.
"""

from __future__ import annotations

import httpx
import pytest

from openk3.sandbox.protocol import Conflict, InvalidArgument, NotFound
from tests.sandbox.test_api_streams import api as api  # noqa: F401 (the fixture: a sandbox with a gate, the service and a client)
from tests.sandbox.test_api_streams import only_init_left, until

pytestmark = pytest.mark.sandbox


def test_stdin_reaches_the_command_and_closing_it_sends_eof(api):
    _svc, client, _url, sid, _root = api
    pid = client.spawn(sid, "cat; echo eof-seen", stdin=True)
    assert client.process_write_stdin(pid, b"line one\n") == 9
    until(lambda: client.process_output(pid).stdout == b"line one\n", "cat to echo the first line")  # it runs while we type
    assert client.process_write_stdin(pid, b"\x00\xffraw") == 5  # bytes, not text
    client.process_close_stdin(pid)
    done = client.process_wait(pid, timeout_s=30)
    assert done.exit_code == 0 and client.process_output(pid).stdout == b"line one\n\x00\xffraweof-seen\n"
    with pytest.raises(Conflict, match="ended"):
        client.process_write_stdin(pid, b"late")


def test_stdin_is_refused_without_the_flag_and_bounded_when_unread(api):
    svc, client, _url, sid, _root = api
    quiet = client.spawn(sid, "cat")  # no stdin=True: it reads EOF at once and nothing can be written
    with pytest.raises(Conflict, match="stdin=True"):
        client.process_write_stdin(quiet, b"x")
    assert client.process_wait(quiet, timeout_s=30).exit_code == 0

    deaf = client.spawn(sid, "echo up; exec sleep 600", stdin=True)  # never reads its stdin
    until(lambda: client.process_output(deaf).stdout == b"up\n", "the deaf command to start")
    taken = client.process_write_stdin(deaf, b"z" * (1 << 20), timeout_s=0.2)
    assert 0 < taken < 1 << 20  # the pipe's buffer, then a short count: the daemon queues nothing of its own
    with pytest.raises(InvalidArgument, match="at most"):
        client.process_write_stdin(deaf, b"z" * ((1 << 20) + 1))
    with pytest.raises(InvalidArgument, match="timeout_s"):
        client.process_write_stdin(deaf, b"z", timeout_s=61)
    client.process_kill(deaf)
    until(lambda: only_init_left(svc, sid), "the killed command to be gone")


def test_signals_reach_the_whole_process_group_by_name_or_number(api):
    svc, client, _url, sid, _root = api
    trapped = client.spawn(sid, "trap 'echo got-usr1; exit 9' USR1; echo ready; while :; do sleep 0.05; done")
    until(lambda: client.process_output(trapped).stdout == b"ready\n", "the trap to be set")
    client.process_signal(trapped, "usr1")
    done = client.process_wait(trapped, timeout_s=30)
    assert done.exit_code == 9 and client.process_output(trapped).stdout == b"ready\ngot-usr1\n"

    group = client.spawn(sid, "sleep 600 & sleep 600 & echo two; wait")
    until(lambda: client.process_output(group).stdout == b"two\n", "both children to start")
    client.process_signal(group, 15)
    assert client.process_wait(group, timeout_s=30).exit_code == 128 + 15
    until(lambda: only_init_left(svc, sid), "the children (same process group) to die with the shell")
    with pytest.raises(Conflict, match="ended"):
        client.process_signal(group, "TERM")


def test_signal_refusals(api):
    _svc, client, url, sid, _root = api
    pid = client.spawn(sid, "exec sleep 600")
    for bad, match in ((0, "1..31"), (32, "1..31"), ("SIGNOPE", "signal name"), (True, "signal")):
        with pytest.raises(InvalidArgument, match=match):
            client.process_signal(pid, bad)
    with pytest.raises(NotFound):
        client.process_signal("bg-nope", "TERM")
    # There is no way to name a pid: an extra field is refused, not ignored.
    r = httpx.post(f"{url}/v1/process_signal", json={"process_id": pid, "signal": "KILL", "pid": 1})
    assert r.status_code == 400 and "pid" in r.json()["error"]["message"]
    client.process_signal(pid, "KILL")
    assert client.process_wait(pid, timeout_s=30).exit_code == 128 + 9
