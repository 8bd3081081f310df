"""Directory watches through the real sync and async clients: inotify events of a sandbox's tree, host paths out of reach,
a bounded queue, and the ends of a watch (stop, the directory gone, a restore).

Each test waits for the events it expects with a generous timeout (`collect`), never for a fixed time.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time

import pytest

from openk3.sandbox.api.client import AsyncSandboxClient
from openk3.sandbox.protocol import InvalidArgument, NotFound
from openk3.sandbox.protocol_interactive import WatchEvent
from tests.sandbox.test_api_streams import api as api  # noqa: F401 (the fixture: a sandbox with a gate, the service and a client)
from tests.sandbox.test_api_streams import until

pytestmark = pytest.mark.sandbox


def collect(client, watch_id: str, until_event: WatchEvent, timeout_s: float = 30.0) -> list[WatchEvent]:
    """Events up to and including `until_event`."""
    deadline = time.monotonic() + timeout_s
    seen: list[WatchEvent] = []
    while until_event not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"timed out waiting for {until_event}; saw {seen}"
        got = client.watch_events(watch_id, timeout_s=min(left, 5.0))
        seen += got.events
        assert got.active or until_event in seen, f"the watch ended ({got.reason}) before {until_event}; saw {seen}"
    return seen


def test_changes_in_the_tree_arrive_with_sandbox_paths(api):
    _svc, client, _url, sid, _root = api
    client.exec(sid, "mkdir -p /root/w")
    w = client.watch_dir(sid, "/root/w")
    client.exec(sid, "mkdir /root/w/sub")
    collect(client, w, WatchEvent("create", "/root/w/sub", True, 0))  # watched from here on (as inotifywait -r)
    client.exec(sid, "echo hi > /root/w/sub/f && chmod 600 /root/w/sub/f && mv /root/w/sub/f /root/w/g && rm /root/w/g")
    seen = collect(client, w, WatchEvent("delete", "/root/w/g", False, 0))
    kinds = [(e.kind, e.path) for e in seen]
    assert kinds == [
        ("create", "/root/w/sub/f"),
        ("modify", "/root/w/sub/f"),
        ("attrib", "/root/w/sub/f"),
        ("moved_from", "/root/w/sub/f"),
        ("moved_to", "/root/w/g"),
        ("delete", "/root/w/g"),
    ]
    assert seen[3].cookie == seen[4].cookie != 0  # a rename is one pair
    client.exec(sid, "mv /root/w/sub /root/w/moved && touch /root/w/moved/after")  # a renamed directory keeps its watch
    collect(client, w, WatchEvent("create", "/root/w/moved/after", False, 0))
    client.watch_stop(w)
    final = client.watch_events(w)
    assert (final.active, final.reason) == (False, "stopped by watch_stop")
    assert list(client.watch_stream(w)) == []  # the sync stream of an ended watch ends at once


def test_host_paths_and_symlinks_are_out_of_reach(api):
    _svc, client, _url, sid, _root = api
    host_dir = tempfile.mkdtemp(prefix="openk3-host-")  # a real directory of the host, outside every sandbox
    try:
        client.exec(sid, f"mkdir -p /root/w && ln -s {host_dir} /root/w/escape && ln -s / /root/w/up")
        with pytest.raises(NotFound):
            client.watch_dir(sid, host_dir)  # a path is the sandbox's: the host's directory of that name is not there
        with pytest.raises(NotFound):
            client.watch_dir(sid, "/root/w/escape")  # a sandbox symlink resolves inside the sandbox, to nothing
        w = client.watch_dir(sid, "/root/w")  # the symlinked directories in the tree are not followed
        with open(os.path.join(host_dir, "host-file"), "w") as f:
            f.write("host")
        client.exec(sid, "touch /tmp/outside-the-tree /root/w/marker")
        seen = collect(client, w, WatchEvent("create", "/root/w/marker", False, 0))
        assert all("host-file" not in e.path and "outside" not in e.path for e in seen), seen
    finally:
        shutil.rmtree(host_dir)


def test_a_flood_costs_a_bounded_queue_and_an_overflow_event(api):
    svc, client, _url, sid, _root = api
    client.exec(sid, "mkdir -p /root/w")
    w = client.watch_dir(sid, "/root/w", max_events=4)
    client.exec(sid, "cd /root/w && touch $(seq 1 50) && touch last")
    # The daemon's thread reads inotify on its own: wait until the queue is full and the loss recorded.
    watch = svc.watches.table.get(w)
    until(lambda: watch._lost, "the flood to fill the daemon's queue")
    got = client.watch_events(w, max_events=100)
    assert [e.path for e in got.events[:4]] == ["/root/w/1"] * 2 + ["/root/w/2"] * 2  # the first four (touch: create, attrib)
    assert [e.kind for e in got.events[4:]] == ["overflow"] and got.active  # then one mark where the rest were dropped


def test_refusals_name_the_argument(api):
    _svc, client, _url, sid, _root = api
    client.exec(sid, "mkdir -p /root/w && touch /root/file")
    for path, error, match in (
        ("root/w", InvalidArgument, "absolute"),
        ("/root/../etc", InvalidArgument, r"'\.\.'"),
        ("/root/file", InvalidArgument, "path"),
        ("/nonexistent", NotFound, "no such directory"),
    ):
        with pytest.raises(error, match=match):
            client.watch_dir(sid, path)
    with pytest.raises(InvalidArgument, match="max_events"):
        client.watch_dir(sid, "/root/w", max_events=0)
    with pytest.raises(InvalidArgument, match="max_dirs"):
        client.watch_dir(sid, "/root/w", max_dirs=1 << 30)
    with pytest.raises(NotFound):
        client.watch_events("wt-nope")
    with pytest.raises(NotFound):
        client.watch_dir("sb-nope@h", "/root")


def test_async_stream_ends_when_the_directory_goes_and_restore_ends_watches(api):
    svc, client, url, sid, _root = api
    client.exec(sid, "mkdir -p /root/w /root/v")
    snap = client.snapshot(sid)

    async def scenario() -> list[WatchEvent]:
        async with AsyncSandboxClient(url) as aclient:
            w = await aclient.watch_dir(sid, "/root/w", recursive=False)
            seen = []
            async for event in aclient.watch_stream(w):
                seen.append(event)
                if event.kind == "create":
                    await aclient.exec(sid, "rm -rf /root/w")  # the watched directory goes: the stream ends
            return seen

    async def first_change() -> None:
        async with AsyncSandboxClient(url) as aclient:
            await aclient.exec(sid, "touch /root/w/one")

    async def both() -> list[WatchEvent]:
        stream = asyncio.ensure_future(scenario())
        while not svc.watches.table.ids():  # the watch exists before the change it must see
            await asyncio.sleep(0.01)
        await first_change()
        return await stream

    seen = asyncio.run(asyncio.wait_for(both(), 60))
    expected = [("create", "/root/w/one"), ("attrib", "/root/w/one"), ("delete", "/root/w/one"), ("delete_self", "/root/w")]
    assert [(e.kind, e.path) for e in seen] == expected

    v = client.watch_dir(sid, "/root/v")
    client.restore(sid, snap.snapshot_id)
    ended = client.watch_events(v)
    assert (ended.active, ended.reason) == (False, "its sandbox was restored")
    client.delete_snapshot(snap.snapshot_id)
