"""What the daemon trusts on its host before any sandbox exists: its cache dir (the helper it runs as root and the base
image), the sandbox uid (nobody else's), the programs it runs to build the base (absolute paths, fixed environment), and
openk3-enter's parsing of what it is given."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from openk3.sandbox.fs import rootfs
from openk3.sandbox.linux import helper
from openk3.sandbox.linux.helper_source import C_SOURCE
from openk3.sandbox.namespace.settings import check_unshared_id
from openk3.sandbox.protocol import InvalidArgument


def test_helper_source_compiles_without_warnings(tmp_path):
    try:
        cc = helper.compiler()
    except helper.Unsupported as e:
        pytest.skip(str(e))
    cmd = [cc, *helper.COMPILE_FLAGS, "-Wextra", "-Werror", "-o", str(tmp_path / "enter"), "-x", "c", "-"]
    done = subprocess.run(cmd, input=C_SOURCE, capture_output=True, text=True, check=False, env=helper.HOST_ENV, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own and chown the directories")
def test_cache_dir_must_be_private_to_root(tmp_path):
    os.chmod(tmp_path, 0o755)
    ok = tmp_path / "ok" / "cache"
    helper.check_private_dir(str(ok), "cache_dir")  # created, 0700
    assert ok.is_dir() and (ok.stat().st_mode & 0o777) == 0o700
    sticky = tmp_path / "sticky"
    sticky.mkdir(mode=0o777)
    os.chmod(sticky, 0o1777)
    helper.check_private_dir(str(sticky / "cache"), "cache_dir")  # like /tmp: others cannot rename root's entries
    with pytest.raises(InvalidArgument, match="cache_dir="):
        helper.check_private_dir(str(sticky), "cache_dir")  # but a sticky world-writable dir is no private dir itself
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(InvalidArgument, match=r"cache_dir=.*mode 0o777"):
        helper.check_private_dir(str(shared / "cache"), "cache_dir")
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, 65534, 65534)  # a user's HOME or XDG_CACHE_HOME
    with pytest.raises(InvalidArgument, match="owner uid 65534"):
        helper.check_private_dir(str(home / ".cache" / "openk3"), "cache_dir")
    link = tmp_path / "link"
    link.symlink_to(shared)
    with pytest.raises(InvalidArgument, match="shared"):
        helper.check_private_dir(str(link / "cache"), "cache_dir")  # the real path is what counts


def test_sandbox_uid_must_be_nobody_elses(tmp_path):
    (tmp_path / "passwd").write_text("root:x:0:0::/root:/bin/sh\nalice:x:1000:100000::/home/alice:/bin/sh\nbroken line\n")
    (tmp_path / "group").write_text("root:x:0:\nsbx:x:200000:\n")
    (tmp_path / "subuid").write_text("# comment\nbob:300000:65536\n")
    (tmp_path / "subgid").write_text("carol:400000:10\n")
    etc = str(tmp_path)
    for uid, hit in ((1000, "user 'alice'"), (100000, "user 'alice'"), (200000, "group 'sbx'"), (365535, "range of 'bob'"), (400009, "carol")):
        with pytest.raises(InvalidArgument, match=f"sandbox_uid={uid}, sandbox_uids=1: .*{hit}"):
            check_unshared_id(uid, etc=etc)
    for uid in (365536, 400010, 500000, 299999):
        check_unshared_id(uid, etc=etc)
    check_unshared_id(100000, etc=str(tmp_path / "missing"))  # no files, nothing to collide with


def test_every_id_of_the_pool_must_be_nobody_elses(tmp_path):
    """Each sandbox runs as one id of sandbox_uid..sandbox_uid+sandbox_uids-1: a user, group or subordinate range anywhere in
    it would share files and limits with a sandbox."""
    (tmp_path / "passwd").write_text("alice:x:1000:1000::/home/alice:/bin/sh\nsvc:x:150000:150000::/:/bin/sh\n")
    (tmp_path / "group").write_text("tty:x:5:\nsbx:x:260000:\n")
    (tmp_path / "subuid").write_text("bob:300000:65536\n")
    etc = str(tmp_path)
    for uid, count, hit in (
        (100000, 65536, "user 'svc'"),  # inside the range, not at its start
        (250000, 10001, "group 'sbx'"),  # the last id
        (290000, 10001, "range of 'bob'"),  # the ranges overlap at one id
        (365535, 10, "range of 'bob'"),  # starts in bob's last id
    ):
        with pytest.raises(InvalidArgument, match=f"sandbox_uid={uid}, sandbox_uids={count}: .*{hit}"):
            check_unshared_id(uid, count, etc)
    for uid, count in ((100000, 50000), (150001, 10000), (240000, 20000), (365536, 65536), (250000, 10000)):
        check_unshared_id(uid, count, etc)


def test_base_libraries_come_from_the_fixed_environment(tmp_path, monkeypatch):
    """ldd runs by absolute path with helper.HOST_ENV: neither the daemon's PATH nor its LD_LIBRARY_PATH picks what every
    sandbox's base gets (or what runs as root while it is built)."""
    libs = rootfs._libraries(["/bin/sh"])
    libc = next(p for p in libs if os.path.basename(p).startswith("libc.so"))
    fake_bin, fake_lib = tmp_path / "bin", tmp_path / "lib"
    fake_bin.mkdir()
    fake_lib.mkdir()
    (fake_bin / "ldd").write_text(f"#!/bin/sh\ntouch {tmp_path}/fake-ldd-ran\n")
    os.chmod(fake_bin / "ldd", 0o755)
    shutil.copy(libc, fake_lib / os.path.basename(libc))
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ.get('PATH', '')}")
    monkeypatch.setenv("LD_LIBRARY_PATH", str(fake_lib))
    assert rootfs._libraries(["/bin/sh"]) == libs
    assert not (tmp_path / "fake-ldd-ran").exists()


def run_enter(path: str, spec: bytes, nprocs: str = "0") -> subprocess.CompletedProcess[bytes]:
    fd = os.memfd_create("spec")
    try:
        os.write(fd, spec)
        return subprocess.run(
            [path, "enter", "0", "1", "00", str(fd), nprocs], pass_fds=(fd,), capture_output=True, timeout=30, check=False, env=helper.HOST_ENV
        )
    finally:
        os.close(fd)


@pytest.mark.sandbox
@pytest.mark.parametrize(
    ("spec", "nprocs"),
    [
        (b"/\x00" + b"99999999999999999999\x00" + b"A=1\x00true\x00", "0"),  # a count past long: ERANGE
        (b"/\x009223372036854775807\x00A=1\x00true\x00", "0"),  # LONG_MAX variables: compared as a difference, no overflow
        (b"/\x002\x00A=1\x00true\x00", "0"),  # more variables than strings, and no argv left
        (b"/\x000\x00", "0"),  # no argv
        (b"/\x000\x00true", "0"),  # not NUL-terminated
        (b"", "0"),  # empty
        (b"/\x000\x00true\x00", "9223372036854775807"),  # LONG_MAX cgroup files
    ],
    ids=["erange", "long-max-env", "short", "no-argv", "unterminated", "empty", "long-max-cgroups"],
)
def test_enter_refuses_malformed_input_before_doing_anything(service, spec, nprocs):
    r = run_enter(service.backend.helper.path, spec, nprocs)
    assert r.returncode == helper.ENTER_FAILED and r.stderr.startswith(helper.ENTER_ERROR_PREFIX), r.stderr
