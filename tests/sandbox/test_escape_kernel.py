"""Escape suite, kernel surface and host traces (issue 18 items 4, 5, 7, 8): the seccomp deny-list and no nested user
namespaces in every sandbox process, capped /dev/shm and inode counts, a read-only /dev, no host path in the sandbox's
mountinfo or cgroup view, and a state dir no other host user can enter."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

import pytest

from openk3.sandbox.protocol import Limits

pytestmark = pytest.mark.sandbox

# Each line: a syscall attempted through ctypes inside the sandbox. The arguments are chosen so that without the filter the
# call fails differently or succeeds, even for a process without capabilities (a missing path, a bad fd, the caller itself
# as target): test_probes_tell_the_filter_apart runs the same script unfiltered to prove that every row can fail.
ATTEMPTS = r"""
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
X86 = dict(mount=165, umount2=166, chroot=161, open_tree=428, fsconfig=431, mount_setattr=442, open_tree_attr=467, setns=308,
           unshare=272, ptrace=101, process_vm_readv=310, pidfd_getfd=438, kcmp=312, process_madvise=440, process_mrelease=448,
           keyctl=250, add_key=248, request_key=249, bpf=321, perf_event_open=298, userfaultfd=323, io_uring_setup=425,
           name_to_handle_at=303, open_by_handle_at=304, quotactl_fd=443, personality=135, clone3=435)
ARM = dict(mount=40, umount2=39, chroot=51, open_tree=428, fsconfig=431, mount_setattr=442, open_tree_attr=467, setns=268,
           unshare=97, ptrace=117, process_vm_readv=270, pidfd_getfd=438, kcmp=272, process_madvise=440, process_mrelease=448,
           keyctl=219, add_key=217, request_key=218, bpf=280, perf_event_open=241, userfaultfd=282, io_uring_setup=425,
           name_to_handle_at=264, open_by_handle_at=265, quotactl_fd=443, personality=92, clone3=435)
NR = {"x86_64": X86, "aarch64": ARM}[os.uname().machine]
c = ctypes.c_long
def attempt(name, *args):
    rc = libc.syscall(c(NR[name]), *args)
    return "ok" if rc >= 0 else errno.errorcode[ctypes.get_errno()]
MISSING = b"/nonexistent-openk3"
pidfd = os.pidfd_open(os.getpid())
handle = ctypes.create_string_buffer(128)  # struct file_handle with handle_bytes = 0: the kernel says how many it needs
mount_id = ctypes.c_int()
out = {
    "mount": attempt("mount", b"none", MISSING, b"tmpfs", c(0), None),
    "umount2": attempt("umount2", MISSING, c(0)),
    "chroot": attempt("chroot", MISSING),
    "open_tree": attempt("open_tree", c(-100), MISSING, c(0)),
    "fsconfig": attempt("fsconfig", c(-1), c(0), None, None, c(0)),
    "mount_setattr": attempt("mount_setattr", c(-1), b"", c(0), None, c(0)),
    "open_tree_attr": attempt("open_tree_attr", c(-100), MISSING, c(0), None, c(0)),
    "setns": attempt("setns", c(-1), c(0)),
    "unshare(CLONE_NEWNS|bad)": attempt("unshare", c(0x00020000 | 0x1)),
    "ptrace": attempt("ptrace", c(12), c(0x7FFFFFFF), None, None),
    "process_vm_readv": attempt("process_vm_readv", c(os.getpid()), None, c(0), None, c(0), c(0)),
    "pidfd_getfd": attempt("pidfd_getfd", c(pidfd), c(0), c(0)),
    "kcmp": attempt("kcmp", c(os.getpid()), c(os.getpid()), c(0), c(0), c(0)),
    "process_madvise": attempt("process_madvise", c(pidfd), None, c(0), c(20), c(0)),
    "process_mrelease": attempt("process_mrelease", c(-1), c(0)),
    "keyctl": attempt("keyctl", c(0), c(-3), c(0)),
    "add_key": attempt("add_key", b"user", b"", b"v", c(1), c(-2)),
    "request_key": attempt("request_key", b"user", b"k", None, c(0)),
    "bpf": attempt("bpf", c(1000), None, c(0)),
    "perf_event_open": attempt("perf_event_open", None, c(0), c(-1), c(-1), c(0)),
    "userfaultfd": attempt("userfaultfd", c(1 | 0x8000)),
    "io_uring_setup": attempt("io_uring_setup", c(1), None),
    "name_to_handle_at": attempt("name_to_handle_at", c(-100), b"/", handle, ctypes.byref(mount_id), c(0)),
    "open_by_handle_at": attempt("open_by_handle_at", c(-1), None, c(0)),
    "quotactl_fd": attempt("quotactl_fd", c(-1), c(0), c(0), None),
    "personality(ADDR_NO_RANDOMIZE)": attempt("personality", c(0x0040000)),
    "personality(query)": attempt("personality", c(0xFFFFFFFF)),
    "clone3": attempt("clone3", None, c(0)),
    "unshare(CLONE_NEWUSER)": attempt("unshare", c(0x10000000)),  # last: unfiltered on a host it succeeds and changes our namespace
}
pid = os.fork()
if pid == 0:
    os._exit(0)
out["fork"] = "ok" if os.waitpid(pid, 0)[1] == 0 else "failed"
for k, v in out.items():
    print(f"{k} {v}")
"""
EXPECTED = {
    **{k: "EPERM" for k in ("mount", "umount2", "chroot", "open_tree", "fsconfig", "mount_setattr", "open_tree_attr", "setns")},
    **{k: "EPERM" for k in ("unshare(CLONE_NEWNS|bad)", "unshare(CLONE_NEWUSER)", "ptrace", "process_vm_readv", "pidfd_getfd", "kcmp")},
    **{k: "EPERM" for k in ("process_madvise", "process_mrelease", "keyctl", "add_key", "request_key", "bpf", "perf_event_open")},
    **{k: "EPERM" for k in ("userfaultfd", "io_uring_setup", "name_to_handle_at", "open_by_handle_at", "quotactl_fd")},
    "personality(ADDR_NO_RANDOMIZE)": "EPERM",
    "personality(query)": "ok",
    "clone3": "ENOSYS",
    "fork": "ok",
}
SYSTEM_PYTHON = "/usr/bin/python3"


def needs_python(svc, sid: str) -> None:
    if svc.exec(sid, "command -v python3").exit_code != 0:
        pytest.skip("the base rootfs has no python3 (the host has no system python3) to make raw syscalls with")


def parse(out: bytes) -> dict[str, str]:
    return dict(line.rsplit(" ", 1) for line in out.decode().splitlines())  # type: ignore[misc]


def test_probes_tell_the_filter_apart():
    """Unfiltered and without capabilities (as nobody on the host), every probe gives another answer than the filter's."""
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"no {SYSTEM_PYTHON} to run the probes with")
    r = subprocess.run([SYSTEM_PYTHON, "-c", ATTEMPTS], user=65534, group=65534, extra_groups=[], capture_output=True, timeout=60, check=False, cwd="/")
    assert r.returncode == 0, r.stderr
    unfiltered = parse(r.stdout)
    assert unfiltered.keys() == EXPECTED.keys()
    same = {k: v for k, v in unfiltered.items() if v == EXPECTED[k] and k not in ("personality(query)", "fork")}
    assert same == {}, f"these probes cannot tell the filter from a process without capabilities: {same}"


def test_seccomp_denies_the_list_in_execs_and_shells(either_svc):
    svc = either_svc
    sid = svc.create()
    try:
        needs_python(svc, sid)
        svc.write_file(sid, "/root/attempts.py", ATTEMPTS.encode())
        r = svc.exec(sid, ["python3", "/root/attempts.py"])
        assert r.exit_code == 0, r.stderr
        assert parse(r.stdout) == EXPECTED
        shell = svc.open_shell(sid)
        assert parse(svc.shell_run(shell, "python3 /root/attempts.py").stdout) == EXPECTED
        # The filter is the kernel's own record, not inferred from errors: mode 2 (filter) with no_new_privs, in both.
        flags = "grep -E '^(Seccomp|NoNewPrivs):' /proc/self/status | tr -d ' \\t'"
        assert svc.shell_run(shell, flags).stdout == b"NoNewPrivs:1\nSeccomp:2\n"
        svc.close_shell(shell)
        assert svc.exec(sid, flags).stdout == b"NoNewPrivs:1\nSeccomp:2\n"
        # The init (and so anything it would fork) runs under bwrap's copy of the same filter, without capabilities.
        with open(f"/proc/{svc.backend.box(sid).init_pid}/status") as f:
            status = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
        assert status["Seccomp"].strip() == "2" and status["NoNewPrivs"].strip() == "1"
        assert status["CapEff"].strip() == status["CapBnd"].strip() == "0000000000000000"
    finally:
        svc.destroy(sid)


def test_no_nested_user_namespace_even_past_seccomp(svc):
    """bwrap --disable-userns: the sandbox's user namespace cannot get a child, even for a process the filter does not cover."""
    nsenter, unshare = shutil.which("nsenter"), shutil.which("unshare")
    if nsenter is None or unshare is None:
        pytest.skip("the host lacks nsenter/unshare (util-linux) to probe the user namespace without the filter")
    sid = svc.create()
    try:
        pid = svc.backend.box(sid).init_pid
        # Host root joins only the init's user namespace (no filter, full capabilities there) and tries to nest one more.
        r = subprocess.run([nsenter, "-t", str(pid), "-U", "--", unshare, "-U", "true"], capture_output=True, text=True, timeout=30, check=False)
        assert r.returncode != 0 and "No space left on device" in r.stderr, r.stderr
        ok = subprocess.run([nsenter, "-t", str(pid), "-U", "--", "true"], capture_output=True, timeout=30, check=False)
        assert ok.returncode == 0  # joining itself works, so the refusal above is the namespace limit
        assert svc.exec(sid, "readlink /proc/self/ns/user").stdout.decode().strip() == os.readlink(f"/proc/{pid}/ns/user")
    finally:
        svc.destroy(sid)


def test_dev_shm_and_inodes_share_the_disk_quota(svc):
    sid = svc.create(limits=Limits(disk_bytes=8 * 2**20, inodes=300))
    try:
        r = svc.exec(sid, "dd if=/dev/zero of=/dev/shm/fill bs=1M count=32 2>&1; ls -l /dev/shm/fill")
        assert b"No space left on device" in r.stdout
        assert int(r.stdout.split()[-5]) <= 8 * 2**20  # ls -l size column
        svc.exec(sid, "rm /dev/shm/fill")
        r = svc.exec(sid, "mkdir /root/many && cd /root/many && i=0; while [ $i -lt 1000 ]; do true > f$i || break; i=$((i+1)); done; echo $i")
        made = int(r.stdout.split()[-1])
        assert 100 < made < 300 and b"No space left on device" in r.stderr, (made, r.stderr[-200:])
        r = svc.exec(sid, "touch /dev/evil")
        assert r.exit_code != 0 and b"Read-only file system" in r.stderr
        assert svc.exec(sid, "echo ok > /dev/null && echo ok").stdout == b"ok\n"
    finally:
        svc.destroy(sid)


def test_no_host_paths_visible_and_state_dir_closed(svc):
    sid, other = svc.create(), svc.create()
    try:
        backend = svc.backend
        mountinfo = svc.exec(sid, "cat /proc/self/mountinfo").stdout.decode()
        assert " / / " in mountinfo  # the overlay root is there ...
        for host_path in (backend.state, backend.base, os.path.dirname(backend.base), backend.config.cache_dir):
            assert host_path not in mountinfo, host_path  # ... named without the daemon's paths
        cgroups = svc.exec(sid, "cat /proc/self/cgroup").stdout.decode()
        assert "openk3-sandbox" not in cgroups and backend.instance_name not in cgroups
        init_cgroup = open(f"/proc/{backend.box(sid).init_pid}/cgroup").read()
        assert backend.cg_prefix in init_cgroup  # while the host sees the real place: the namespace is rooted there
        box = backend.box(sid)
        uid = box.uid
        assert uid is not None and uid != backend.box(other).uid
        for path, owner, mode in (
            (backend.state, (0, 0), 0o711),
            (os.path.join(backend.state, "sbx"), (0, 0), 0o711),
            (box.dir, (0, uid), 0o710),
            (os.path.join(box.dir, "shm"), (uid, uid), 0o700),
            (os.path.join(box.dir, "w"), (0, 0), 0o700),
            (backend.store.root, (0, 0), 0o700),
        ):
            st = os.stat(path)
            assert ((st.st_uid, st.st_gid), stat.S_IMODE(st.st_mode)) == (owner, mode), path
        # The sandbox's uid on the host (a process that left its mount namespace) can list nothing and reach no layer; another
        # sandbox's uid, and the layers' owner (which no process runs as), cannot even pass into its dir.
        for path in (backend.state, os.path.join(backend.state, "sbx"), backend.store.root, box.dir):
            r = subprocess.run(["/bin/ls", path], user=uid, group=uid, extra_groups=[], capture_output=True, text=True, check=False, env={})
            assert r.returncode != 0 and "Permission denied" in r.stderr, path
        for stranger in (backend.box(other).uid, backend.config.sandbox_uid):
            r = subprocess.run(
                ["/bin/ls", os.path.join(box.dir, "u")], user=stranger, group=stranger, extra_groups=[], capture_output=True, text=True, check=False, env={}
            )
            assert r.returncode != 0 and "Permission denied" in r.stderr, stranger
    finally:
        svc.destroy(sid)
        svc.destroy(other)


def test_other_host_users_cannot_reach_a_live_sandbox(svc):
    """The sandbox's paths are in the host's mountinfo; as `nobody` neither its files nor its /dev/shm can be reached."""
    sid = svc.create()
    try:
        svc.exec(sid, "mkdir -p /work && echo 42 > /work/answer.txt && chmod 644 /work/answer.txt && echo s > /dev/shm/seg")
        box = svc.backend.box(sid)
        assert box.dir in open("/proc/self/mountinfo").read()  # the names are no secret ...
        targets = [os.path.join(box.merged, "work/answer.txt"), os.path.join(box.dir, "u/work/answer.txt"), os.path.join(box.dir, "shm/seg")]
        assert all(open(t).read() for t in targets)  # ... and the files are there for root
        probe = 'for t in "$1" "$2" "$3"; do cat "$t" && echo "read $t"; done; (echo x > "$4") && echo "wrote $4"; true'
        injected = os.path.join(box.dir, "shm/injected")
        r = subprocess.run(
            ["/bin/sh", "-c", probe, "sh", *targets, injected], user=65534, group=65534, extra_groups=[], capture_output=True, text=True, check=False, cwd="/"
        )
        assert (r.returncode, r.stdout) == (0, "") and r.stderr.count("Permission denied") == 4, (r.stdout, r.stderr)
        assert not os.path.exists(injected)
        assert svc.exec(sid, "cat /work/answer.txt").stdout == b"42\n"
    finally:
        svc.destroy(sid)
