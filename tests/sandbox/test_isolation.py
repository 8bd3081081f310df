"""Spec test plan 1, 2, 8, 9: reads and writes outside the root, network, privileges."""

from __future__ import annotations

import hashlib
import os
import socket
import threading

import pytest

from openk3.sandbox.protocol import NotFound

pytestmark = pytest.mark.sandbox


def sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "host-marker.txt"
    path.write_text("host secret\n")
    return str(path)


def test_reads_outside_root_fail(svc, marker):
    a, b = svc.create(), svc.create()
    try:
        svc.exec(b, "echo other-secret > /root/secret")
        b_upper = os.path.join(svc.backend.box(b).dir, "u", "root", "secret")
        assert open(b_upper).read() == "other-secret\n"  # the file exists on the host, in b's upper
        for cmd in (
            f"cat {marker}",
            f"cat {b_upper}",
            f"cat /proc/1/root{marker}",
            f"cat ../../../../../..{marker}",
            f"cd / && cat ./../../..{marker}",
            "cat /proc/1/root/etc/shadow",
        ):
            r = svc.exec(a, cmd)
            assert r.exit_code != 0 and b"secret" not in r.stdout, cmd
        # Host-side API reads resolve inside the sandbox root: a symlink to /etc/passwd gives the sandbox's passwd.
        svc.exec(a, "ln -s /etc/passwd /root/pw && ln -s ../../../../../../../etc/passwd /root/pw2 && ln -s /proc/1/root /root/pr")
        sandbox_passwd = svc.exec(a, "cat /etc/passwd").stdout
        assert sandbox_passwd != open("/etc/passwd", "rb").read()
        for path in ("/root/pw", "/root/pw2", "/../../../etc/passwd", "/root/../../etc/passwd"):
            assert svc.read_file(a, path) == sandbox_passwd, path
        for path in (marker, f"/root/pr{marker}", b_upper, "/proc/self/environ"):
            with pytest.raises(NotFound):
                svc.read_file(a, path)
    finally:
        svc.destroy(a)
        svc.destroy(b)


def test_writes_outside_root_leave_host_unchanged(svc, marker):
    before = sha(marker), sha("/etc/passwd")
    sid = svc.create()
    try:
        r = svc.exec(
            sid,
            f"mkdir -p $(dirname {marker}); echo pwned > {marker}; echo pwned >> /etc/passwd; "
            f"echo pwned > /proc/1/root{marker}; ln -s {marker} /root/l; echo pwned > /root/l",
        )
        assert b"pwned" not in r.stdout
        svc.exec(sid, "ln -s /etc/passwd /root/pw")
        svc.write_file(sid, "/root/pw", b"api-pwned\n")
        svc.write_file(sid, f"/../../..{marker}", b"api-pwned\n")
        assert svc.read_file(sid, "/etc/passwd") == b"api-pwned\n"  # the sandbox's own copy changed ...
    finally:
        svc.destroy(sid)
    assert (sha(marker), sha("/etc/passwd")) == before  # ... the host's did not


def test_no_network(svc):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    accepted = []

    def accept() -> None:
        try:
            accepted.append(listener.accept())
        except OSError:
            pass

    t = threading.Thread(target=accept)
    t.start()
    sid = svc.create()
    try:
        r = svc.exec(sid, ["bash", "-c", f"echo hello > /dev/tcp/127.0.0.1/{port}"])
        assert r.exit_code != 0
        ifaces = svc.exec(sid, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '").stdout.split()
        assert ifaces == [b"lo"]
    finally:
        svc.destroy(sid)
        t.join()
        listener.close()
    assert accepted == []


def test_no_privileges_beyond_own_namespaces(either_svc):
    """With either sandbox uid: as host root (sandbox_uid=None) bwrap would keep every capability without --cap-drop ALL."""
    svc = either_svc
    sid = svc.create()
    try:
        r = svc.exec(sid, "mknod /root/sda b 8 0")
        assert r.exit_code != 0 and b"Operation not permitted" in r.stderr
        r = svc.exec(sid, "mknod /root/null c 1 3")
        assert r.exit_code != 0
        status = svc.exec(sid, "grep -E '^Cap(Eff|Prm|Inh|Bnd|Amb)' /proc/self/status").stdout.decode()
        assert len(status.splitlines()) == 5 and all(line.split()[1] == "0000000000000000" for line in status.splitlines())
        with open(f"/proc/{svc.backend.box(sid).init_pid}/status") as f:
            init_caps = [line.split()[1] for line in f if line.startswith("Cap")]
        assert init_caps == ["0000000000000000"] * 5  # the init, the sandbox's own bash, too
        r = svc.exec(sid, "echo 1 > /proc/sys/kernel/sysrq")
        assert r.exit_code != 0
        # Its root is the only id mapped, to an unprivileged host uid of its own (read from the host, the map is relative to
        # the host); inside, the map is relative to the intermediate namespace bwrap --disable-userns puts in between.
        host_uid = svc.backend.box(sid).uid or 0
        assert host_uid != (svc.backend.config.sandbox_uid or 0) or host_uid == 0  # never the layers' owner
        with open(f"/proc/{svc.backend.box(sid).init_pid}/uid_map") as f:
            assert f.read().split() == ["0", str(host_uid), "1"]
        assert svc.exec(sid, "cat /proc/self/uid_map").stdout.split() == [b"0", b"0", b"1"]
        svc.exec(sid, "echo x > /root/mine")
        assert os.stat(os.path.join(svc.backend.box(sid).dir, "u", "root", "mine")).st_uid == host_uid
    finally:
        svc.destroy(sid)
