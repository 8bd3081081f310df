"""One namespace sandbox: its tmpfs, overlay root, cgroups and persistent init under bwrap.

Layout on the daemon's state tmpfs: `sbx/<short id>/` is a tmpfs of `limits.disk_bytes` and `limits.inodes` (the disk quota)
holding `u` (overlay upper), `w` (overlay work dir), `m` (the merged root) and `shm` (the sandbox's /dev/shm, so shared memory
files count against the same quota). The init is bwrap with user, mount, pid, net, ipc, uts and cgroup namespaces, no network,
no further user namespaces and the seccomp filter (linux/seccomp.py), whose pid 1 is a `bash` blocked on a pipe from the
daemon; commands join it through openk3-enter (linux/helper.py), which also drops their capabilities and loads the filter.
Contract: the caller (lifecycle.py, backend.py) holds `lock` around every method that mounts, unmounts or (re)starts the init.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable

from openk3.sandbox.linux import proc, ptys, syscalls
from openk3.sandbox.linux.cgroups import CgroupSet
from openk3.sandbox.linux.helper import ENTER_ERROR_PREFIX, ENTER_FAILED, HOST_ENV, Helper, command_argv, command_spec, environment
from openk3.sandbox.namespace.bwrap import init_argv
from openk3.sandbox.namespace.startup import StartupError, pin, wait_ready
from openk3.sandbox.protocol import ExecResult, Limits, SandboxError

BASE_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/root", "LANG": "C.UTF-8", "TERM": "dumb"}
# The init is pid 1 itself (bwrap --as-pid-1), so nothing inside can kill it (`kill -9 -1` included). It says it is up (the
# root is mounted by then) and blocks reading a pipe the daemon holds: no CPU, no external binary that could be deleted, and
# it exits when the daemon goes away (EOF). bash rather than dash: bash's SIGCHLD handler reaps adopted orphans and its
# `read` resumes after the signal, where dash's `read` returns and would end the loop.
INIT_COMMAND = ["/bin/bash", "--noprofile", "--norc", "-c", "echo ready; while read -r _; do :; done"]


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):  # gone; a process reaped between open and read is ESRCH
        return None


class Instance:
    def __init__(
        self,
        sid: str,
        dir: str,
        base: str,
        layers: tuple[str, ...],
        layer_paths: list[str],
        limits: Limits,
        cg: CgroupSet,
        env: dict[str, str],
        workdir: str,
        bwrap: str,
        helper: Helper,
        uid: int | None,
        idmap: int | None,
        max_ptys: int,
        init_timeout_s: float = 10.0,
    ) -> None:
        self.sid = sid
        self.layers = layers  # digests of the layer stack, bottom first; fixed for the instance's life
        self.dir = dir
        self.base = base
        self.limits = limits
        self.cg = cg
        self.env = {**BASE_ENV, **env}
        self.workdir = workdir
        self.bwrap = bwrap
        self.helper = helper
        self.uid = uid  # host uid of the sandbox's root, its own (uids.py); None = host root
        self.idmap = idmap  # user namespace mapping the layers' owner to `uid` (the pool's fd); None = layers as they are
        self.max_ptys = max_ptys  # the `max=` of its /dev/pts (linux/ptys.py)
        self.init_timeout_s = init_timeout_s
        self.lock = threading.RLock()
        self.init: subprocess.Popen[bytes] | None = None
        self.init_pid: int | None = None
        self.init_pidfd: int | None = None  # pins the init for openk3-enter: a pid alone could be reused after it dies
        self._leaf_lock = threading.Lock()
        self._next_leaf = 0
        self.lingering: set[str] = set()
        self.mounted = False
        self.mount_root(layer_paths)

    @property
    def merged(self) -> str:
        return os.path.join(self.dir, "m")

    def mount_root(self, layer_paths: list[str]) -> None:
        """tmpfs (the quota) + overlay of `layer_paths` (bottom first) over the base rootfs.

        The sandbox's tmpfs is 0710 root:<its gid>: bwrap, running as the sandbox's uid, must resolve the root's path (see
        settings.check_traversable), and no other host user (another sandbox's uid included) may reach its files, although
        the path is in the host's mountinfo. `shm` (its /dev/shm) and the upper belong to the sandbox's root, as the lower
        layers seem to through their idmapped mounts.
        """
        os.makedirs(self.dir, exist_ok=True)
        group, mode = (0, "0700") if self.uid is None else (self.uid, "0710")
        opts = f"size={self.limits.disk_bytes},nr_inodes={self.limits.inodes},mode={mode},uid=0,gid={group}"
        syscalls.mount("tmpfs", self.dir, "tmpfs", syscalls.MS_NOSUID | syscalls.MS_NODEV, opts)
        try:
            for d in ("u", "w", "m", "shm"):
                os.mkdir(os.path.join(self.dir, d), 0o700 if d in ("w", "shm") else 0o755)
            if self.uid is not None:
                for d in ("u", "shm"):  # the merged "/" takes the upper root's owner
                    os.chown(os.path.join(self.dir, d), self.uid, self.uid)
            lowers = [*reversed(layer_paths), self.base]
            syscalls.mount_overlay(self.merged, lowers, os.path.join(self.dir, "u"), os.path.join(self.dir, "w"), self.idmap)
        except OSError:
            syscalls.umount(self.dir, detach=True)
            raise
        self.mounted = True

    def unmount_root(self) -> None:
        if not self.mounted:
            return
        for point in (self.merged, self.dir):
            try:
                syscalls.umount(point)
            except OSError:
                # A host thread still holds a file in it (a concurrent read_file): detach now, the kernel frees it after.
                syscalls.umount(point, detach=True)
        self.mounted = False

    def new_leaf(self) -> str:
        with self._leaf_lock:
            self._next_leaf += 1
            return f"x{self._next_leaf}"

    def start_init(self) -> None:
        """Start bwrap as the sandbox uid inside the sandbox's cgroups, wait for "ready", pin the init with a pidfd, then cap
        its ptys (linux/ptys.py).

        openk3-enter joins the cgroups before it execs bwrap, so bwrap's cgroup namespace is rooted at the sandbox's own
        cgroup (no host cgroup path is visible inside) and nothing runs outside the limits even for a moment.
        """
        info_r, info_w = os.pipe()
        filter_r, filter_w = os.pipe()
        os.write(filter_w, bytes.fromhex(self.helper.seccomp_hex))  # a few hundred bytes: fits the pipe buffer
        os.close(filter_w)
        # The root and /dev/shm are handed over as open fds, so the init's command line shows no host path; bwrap still
        # resolves their paths as the sandbox uid (see settings.check_traversable).
        root_fd = os.open(self.merged, os.O_PATH | os.O_DIRECTORY)
        shm_fd = os.open(os.path.join(self.dir, "shm"), os.O_PATH | os.O_DIRECTORY)
        # The init gets the base environment only: it runs no task code, and a caller's variable (an LD_PRELOAD of a library
        # that is not there) must not be able to stop it from starting. Commands get the sandbox's env from openk3-enter.
        bwrap = init_argv(self.bwrap, root_fd, shm_fd, filter_r, info_w, BASE_ENV, INIT_COMMAND)
        try:
            # A session of its own: in the daemon's process group, `kill 0` from inside would reach the daemon (sandbox_uid
            # None) and every other sandbox's bwrap; in its session, /dev/tty would be the operator's terminal.
            self.init = subprocess.Popen(
                self.helper.spawn_argv(self.cg.procs_files("init"), self.uid, bwrap),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(info_w, root_fd, shm_fd, filter_r),
                env=HOST_ENV,
                start_new_session=True,
            )
        except BaseException:
            os.close(info_r)
            raise
        finally:
            for fd in (info_w, root_fd, shm_fd, filter_r):
                os.close(fd)
        out = self.init.stdout
        assert out is not None
        try:
            with os.fdopen(info_r, "rb") as info:
                pid = wait_ready(out.fileno(), info.fileno(), self.init_timeout_s)
                self.init_pidfd = pin(pid, self.init.pid)
            try:
                early = ptys.cap(pid, self.init_pidfd, self.max_ptys)
            except OSError as e:
                raise StartupError(f"capping its ptys at sandbox_ptys={self.max_ptys}: {e}") from e
            if early:
                raise StartupError(f"it opened ptys {early[:8]} before they were capped at sandbox_ptys={self.max_ptys}")
        except StartupError as e:
            # The helper first (if the deadline passed before it joined the cgroups, a cgroup kill would miss it), then the
            # whole sandbox: whatever the init started must not outlive the failed start.
            self.init.kill()
            self.cg.kill()
            out.close()
            self.init.wait()
            self._close_stdin()
            self.init = None
            if self.init_pidfd is not None:
                os.close(self.init_pidfd)
                self.init_pidfd = None
            raise SandboxError(f"sandbox {self.sid}: init failed to start: {e}") from e
        out.close()
        self.init_pid = pid

    def _close_stdin(self) -> None:
        if self.init is not None and self.init.stdin is not None and not self.init.stdin.closed:
            try:
                self.init.stdin.close()
            except BrokenPipeError:
                pass

    def alive(self) -> bool:
        """bwrap and the sandbox's pid 1 run (only the host can kill pid 1, e.g. a destroy racing with this call)."""
        if self.init is None or self.init.poll() is not None or self.init_pid is None:
            return False
        return _state(self.init_pid) not in ("Z", "X", None)

    def stop_all(self) -> None:
        """Kill every process of the sandbox (init included) and reap the init."""
        self.cg.kill()
        if self.init is not None:
            self.init.wait()
            self._close_stdin()
            self.init = None
            self.init_pid = None
        if self.init_pidfd is not None:
            os.close(self.init_pidfd)
            self.init_pidfd = None
        if not self.cg.wait_empty():
            raise SandboxError(f"sandbox {self.sid}: processes survived SIGKILL: {self.cg.pids()}")
        for leaf in list(self.lingering):
            if self.cg.remove_child(leaf):
                self.lingering.discard(leaf)

    def ensure_init(self) -> tuple[int, int]:
        """The init's pid and a duplicate of its pidfd (the caller closes it), so a concurrent restart cannot close it under us."""
        with self.lock:
            if not self.alive():
                # Someone killed pid 1 from inside (kill -9 -1); files survive, so start a fresh init.
                self.stop_all()
                self.start_init()
            assert self.init_pid is not None and self.init_pidfd is not None
            return self.init_pid, os.dup(self.init_pidfd)

    def enter_argv(self, leaf: str, cmd: str | list[str], cwd: str | None, env: dict[str, str], tty: bool = False) -> tuple[list[str], tuple[int, int]]:
        """openk3-enter's command line for `cmd` with the sandbox's env plus `env`, and the descriptors it names (its pidfd of
        the init and the memfd holding the command): pass them, then close them. `tty`: stdin is a pty slave to make the
        command's controlling terminal (namespace/terminal.py)."""
        variables = environment({**self.env, **env}, "env")
        spec = command_spec(cwd or self.workdir, variables, command_argv(cmd))
        try:
            pid, pidfd = self.ensure_init()
        except BaseException:
            os.close(spec)
            raise
        return self.helper.enter_argv(pidfd, pid, spec, self.cg.procs_files(leaf), tty), (pidfd, spec)

    def finish_leaf(self, leaf: str) -> None:
        """Drop an exec's cgroup, or remember it while background children it left (nohup, daemons) still run."""
        if not self.cg.remove_child(leaf):
            self.lingering.add(leaf)
        for old in list(self.lingering):
            if self.cg.remove_child(old):
                self.lingering.discard(old)

    def exec(
        self,
        cmd: str | list[str],
        timeout_s: float,
        cwd: str | None,
        env: dict[str, str],
        stdin: bytes | int | None,
        max_output_bytes: int,
        retry: bool = True,
        stdout_fd: int | None = None,
        on_output: proc.OnOutput | None = None,
        stop: threading.Event | None = None,
        on_start: Callable[[int], None] | None = None,
    ) -> ExecResult:
        leaf = self.new_leaf()
        argv, fds = self.enter_argv(leaf, cmd, cwd, env)
        leaf_path = os.path.join(self.cg.control, leaf)
        ooms = self.cg.oom_kills()

        def kill_tree() -> None:
            self.cg.kill(leaf_path)

        try:
            got = proc.run_captured(
                argv, HOST_ENV, stdin, timeout_s, max_output_bytes, kill_tree, fds, stdout_fd, on_output=on_output, stop=stop, on_start=on_start
            )
            if got.timed_out or got.stopped:
                self.cg.wait_empty(leaf_path, timeout_s=1.0)
        finally:
            for fd in fds:
                os.close(fd)
            self.finish_leaf(leaf)
        if retry and got.returncode == ENTER_FAILED and got.stderr.startswith(ENTER_ERROR_PREFIX) and not self.alive():
            # The init died between our liveness check and openk3-enter (e.g. after `kill -9 -1`): the command never
            # started, so starting a new init and running it once more is safe.
            return self.exec(cmd, timeout_s, cwd, env, stdin, max_output_bytes, False, stdout_fd, on_output, stop, on_start)
        return ExecResult(
            exit_code=got.returncode,
            stdout=got.stdout,
            stderr=got.stderr,
            timed_out=got.timed_out,
            oom_killed=self.cg.oom_kills() > ooms,
            duration_ms=got.duration_ms,
            truncated=got.truncated,
        )

    def disk_used(self) -> int:
        st = os.statvfs(self.dir)
        return (st.f_blocks - st.f_bfree) * st.f_frsize

    def disk_full(self) -> bool:
        """Its disk quota is (all but) used up: less than 64 KiB or no inode left, as after a write that hit ENOSPC."""
        st = os.statvfs(self.dir)
        return st.f_bavail * st.f_frsize < 64 << 10 or st.f_favail == 0

    def teardown(self) -> None:
        """Everything this instance holds on the host, in reverse order of creation: processes, mounts, cgroups."""
        with self.lock:
            self.stop_all()
            self.unmount_root()
            os.rmdir(self.dir)
            deadline = time.monotonic() + 2.0
            while True:
                try:
                    self.cg.remove()
                    return
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.001)
