"""Pieces that need no namespaces: cgroup layout detection for v1, v2 and hybrid hosts, wire framing, protocol JSON."""

from __future__ import annotations

import json
import socket

import pytest

from openk3.sandbox.linux.cgroups import detect_layout
from openk3.sandbox.process import wire
from openk3.sandbox.protocol import ExecResult, InvalidArgument, Limits, SnapshotInfo, SnapshotKind, from_jsonable, to_jsonable

V2 = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V1 = "".join(
    f"{40 + i} 30 0:{30 + i} / /sys/fs/cgroup/{name} rw - cgroup cgroup rw,{opts}\n"
    for i, (name, opts) in enumerate([("cpu,cpuacct", "cpu,cpuacct"), ("memory", "memory"), ("pids", "pids"), ("freezer", "freezer")])
)
HYBRID = V1 + "50 30 0:40 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"


def test_pure_v2_puts_everything_in_one_tree():
    layout = detect_layout(V2, "cpuset cpu io memory pids")
    assert layout.name == "v2"
    assert layout.control_root == "/sys/fs/cgroup"
    assert {layout.limit_root(c) for c in ("memory", "pids", "cpu")} == {"/sys/fs/cgroup"}


def test_pure_v1_uses_freezer_and_controller_hierarchies():
    layout = detect_layout(V1)
    assert layout.name == "v1"
    assert layout.control_root == "/sys/fs/cgroup/freezer"
    assert layout.limit_root("memory") == "/sys/fs/cgroup/memory"
    assert layout.limit_root("cpu") == "/sys/fs/cgroup/cpu,cpuacct"


def test_hybrid_limits_in_v1_freeze_and_kill_in_v2():
    layout = detect_layout(HYBRID, "")  # the unified tree has no controllers, as on the measured hosts
    assert layout.name == "hybrid"
    assert layout.control_root == "/sys/fs/cgroup/unified"
    assert layout.limit_root("pids") == "/sys/fs/cgroup/pids"
    partly = detect_layout(HYBRID, "memory")  # a controller moved to v2 is used there
    assert partly.limit_root("memory") == "/sys/fs/cgroup/unified" and partly.limit_root("pids") == "/sys/fs/cgroup/pids"


def test_limits_validation_names_the_field():
    with pytest.raises(InvalidArgument, match="limits.pids=1"):
        Limits(pids=1)
    with pytest.raises(InvalidArgument, match="limits.cpus"):
        Limits(cpus=0)


def test_protocol_json_round_trip():
    r = ExecResult(exit_code=1, stdout=b"\x00\xff", stderr=b"", timed_out=False, oom_killed=True, duration_ms=1.5, truncated=False)
    assert from_jsonable(ExecResult, to_jsonable(r)) == r
    s = SnapshotInfo("snap-1@h", SnapshotKind.FS, ("a", "b"), "sb-1@h", 1.0, "files")
    assert from_jsonable(SnapshotInfo, to_jsonable(s)) == s
    older = {k: v for k, v in to_jsonable(s).items() if k != "stored_bytes"}  # a daemon from before the field existed
    assert from_jsonable(SnapshotInfo, older).stored_bytes == 0
    with pytest.raises(KeyError):  # a field without a default cannot be made up
        from_jsonable(SnapshotInfo, {k: v for k, v in older.items() if k != "layers"})


def test_wire_messages_carry_descriptors():
    a, b = socket.socketpair()
    r, w = socket.socketpair()
    try:
        wire.send(a, {"op": "x", "blob": "y" * 200_000}, [w.fileno()])
        msg, fds = wire.recv(b)
        assert msg == {"op": "x", "blob": "y" * 200_000} and len(fds) == 1
        passed = socket.socket(fileno=fds[0])
        passed.sendall(b"ping")
        assert r.recv(4) == b"ping"
        passed.close()
        a.close()
        with pytest.raises(EOFError):
            wire.recv(b)
    finally:
        for s in (b, r, w):
            s.close()


def test_cli_registers_sandbox_serve():
    import argparse

    from openk3.sandbox import cli

    parser = argparse.ArgumentParser(prog="openk3")
    cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["sandbox", "serve", "--port", "8123", "--workers", "2"])
    assert (args.func, args.port, args.workers, args.host, args.sandbox_uid) == (cli.run, 8123, 2, "127.0.0.1", 100_000)
    assert parser.parse_args(["sandbox", "serve", "--sandbox-uid", "1900000000"]).sandbox_uid == 1_900_000_000


def test_probe_names_what_is_missing(monkeypatch):
    from openk3.sandbox.linux import host

    monkeypatch.setattr(host.os, "geteuid", lambda: 1000)
    reason = host.probe().unavailable_reason
    assert reason is not None and reason.startswith("not root")
    monkeypatch.setattr(host.os, "geteuid", lambda: 0)
    real_which = host.helper.shutil.which
    monkeypatch.setattr(host.helper.shutil, "which", lambda name, *a, **k: None if name == "bwrap" else real_which(name, *a, **k))
    reason = host.probe().unavailable_reason
    assert reason is not None and "bubblewrap" in reason


def test_backend_config_validation_names_the_field():
    from openk3.sandbox.namespace.settings import BackendConfig

    for kwargs, field in (
        ({"max_layers": 100}, "max_layers=100"),
        ({"sandbox_uid": 0}, "sandbox_uid=0"),
        ({"store_bytes": 1}, "store_bytes=1"),
        ({"host": "a@b"}, "host='a@b'"),
        ({"init_timeout_s": 0}, "init_timeout_s=0"),
        ({"sandbox_uids": 1}, "sandbox_uids=1"),
        ({"sandbox_ptys": 2**20 + 1}, f"sandbox_ptys={2**20 + 1}"),
    ):
        with pytest.raises(InvalidArgument, match=field):
            BackendConfig(**kwargs)


def test_wire_tags_are_unambiguous() -> None:
    """Bytes travel as {"b64": ...}; a caller's dict that looks like a tag comes back a dict, not bytes."""
    from openk3.sandbox.protocol import decode_tagged, to_jsonable

    values = [b"\x00\xff", {"b64": "aGk="}, {"dict": {"b64": b"x"}}, {"env": {"b64": "1"}}, [b"a", {"dict": 1}], "b64"]
    for value in values:
        assert decode_tagged(json.loads(json.dumps(to_jsonable(value)))) == value
