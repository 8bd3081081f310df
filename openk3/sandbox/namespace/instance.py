"""One namespace sandbox: its tmpfs, overlay root, cgroups and persistent init under bwrap.

Layout on the daemon's state tmpfs: `sbx/<short id>/` is a tmpfs of `limits.disk_bytes` (the disk quota) holding `u` (overlay
upper), `w` (overlay work dir) and `m` (the merged root). The init is bwrap with user, mount, pid, net, ipc, uts and cgroup
namespaces and no network, whose pid 1 is a `bash` blocked on a pipe from the daemon; commands join its namespaces with nsenter.
Contract: the caller (lifecycle.py, backend.py) holds `lock` around every method that mounts, unmounts or (re)starts the init.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time

from openk3.sandbox.linux import proc, syscalls
from openk3.sandbox.linux.cgroups import CgroupSet
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
    except (FileNotFoundError, IndexError):
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
        uid: int | None,
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
        self.uid = uid  # host uid of the sandbox's root; None = host root
        self.lock = threading.RLock()
        self.init: subprocess.Popen[bytes] | None = None
        self.init_pid: int | None = None
        self._leaf_lock = threading.Lock()
        self._next_leaf = 0
        self.lingering: set[str] = set()
        self.mounted = False
        self.mount_root(layer_paths)

    @property
    def merged(self) -> str:
        return os.path.join(self.dir, "m")

    def mount_root(self, layer_paths: list[str]) -> None:
        """tmpfs (the quota) + overlay of `layer_paths` (bottom first) over the base rootfs."""
        os.makedirs(self.dir, exist_ok=True)
        syscalls.mount("tmpfs", self.dir, "tmpfs", syscalls.MS_NOSUID | syscalls.MS_NODEV, f"size={self.limits.disk_bytes},mode=0755")
        try:
            for d in ("u", "w", "m"):
                os.mkdir(os.path.join(self.dir, d))
            if self.uid is not None:
                os.chown(os.path.join(self.dir, "u"), self.uid, self.uid)  # the merged "/" takes the upper root's owner
            lower = ":".join([*reversed(layer_paths), self.base])
            opts = f"lowerdir={lower},upperdir={self.dir}/u,workdir={self.dir}/w,redirect_dir=off,metacopy=off,index=off"
            syscalls.mount("overlay", self.merged, "overlay", syscalls.MS_NOSUID | syscalls.MS_NODEV, opts)
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
        """Start bwrap as the sandbox uid, wait for "ready", then move its two processes into the sandbox's cgroups.

        Moving them afterwards (instead of through the cgroup trampoline execs use) saves two execs on every create and cold
        restore, and is race-free: until now only bwrap and the init's own `bash` exist, and no user code has run.
        """
        info_r, info_w = os.pipe()
        # The root is handed over as an open fd: bwrap runs as the sandbox uid, which may not traverse the state dir's parents.
        root_fd = os.open(self.merged, os.O_PATH | os.O_DIRECTORY)
        argv = [
            self.bwrap,
            "--unshare-user",
            "--unshare-pid",
            "--unshare-net",
            "--unshare-ipc",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--uid",
            "0",
            "--gid",
            "0",
            "--hostname",
            "sandbox",
            "--bind-fd",
            str(root_fd),
            "/",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--new-session",
            "--as-pid-1",
            "--info-fd",
            str(info_w),
            "--chdir",
            "/",
            "--",
            *INIT_COMMAND,
        ]
        try:
            self.init = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(info_w, root_fd),
                env=self.env,
                user=self.uid,
                group=self.uid,
                extra_groups=None if self.uid is None else [],
            )
        finally:
            os.close(info_w)
            os.close(root_fd)
        assert self.init.stdout is not None
        first = self.init.stdout.readline()
        with os.fdopen(info_r, "rb") as f:
            info = f.read()
        if first != b"ready\n":
            rest = first + self.init.stdout.read() if self.init.poll() is not None else first
            self.init.stdout.close()
            self.init.kill()
            self.init.wait()
            self._close_stdin()
            raise SandboxError(f"sandbox {self.sid}: init failed to start: {rest.decode(errors='replace').strip()}")
        self.init.stdout.close()
        self.init_pid = int(json.loads(info)["child-pid"])
        with open(f"/proc/{self.init_pid}/task/{self.init_pid}/children") as f:
            pids = [self.init.pid, self.init_pid, *(int(p) for p in f.read().split())]
        for procs in self.cg.procs_files("init"):
            for pid in pids:
                with open(procs, "w") as f:
                    f.write(str(pid))

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
        if not self.cg.wait_empty():
            raise SandboxError(f"sandbox {self.sid}: processes survived SIGKILL: {self.cg.pids()}")
        for leaf in list(self.lingering):
            if self.cg.remove_child(leaf):
                self.lingering.discard(leaf)

    def ensure_init(self) -> int:
        with self.lock:
            if not self.alive():
                # Someone killed pid 1 from inside (kill -9 -1); files survive, so start a fresh init.
                self.stop_all()
                self.start_init()
            assert self.init_pid is not None
            return self.init_pid

    def enter_argv(self, leaf: str, cmd: str | list[str], cwd: str | None) -> list[str]:
        return proc.cgroup_trampoline(self.cg.procs_files(leaf)) + proc.enter_argv(self.ensure_init()) + proc.command_argv(cmd, cwd or self.workdir)

    def finish_leaf(self, leaf: str) -> None:
        """Drop an exec's cgroup, or remember it while background children it left (nohup, daemons) still run."""
        if not self.cg.remove_child(leaf):
            self.lingering.add(leaf)
        for old in list(self.lingering):
            if self.cg.remove_child(old):
                self.lingering.discard(old)

    def exec(
        self, cmd: str | list[str], timeout_s: float, cwd: str | None, env: dict[str, str], stdin: bytes | None, max_output_bytes: int, retry: bool = True
    ) -> ExecResult:
        leaf = self.new_leaf()
        argv = self.enter_argv(leaf, cmd, cwd)
        leaf_path = os.path.join(self.cg.control, leaf)
        ooms = self.cg.oom_kills()

        def kill_tree() -> None:
            self.cg.kill(leaf_path)

        try:
            got = proc.run_captured(argv, {**self.env, **env}, stdin, timeout_s, max_output_bytes, kill_tree)
            if got.timed_out:
                self.cg.wait_empty(leaf_path, timeout_s=1.0)
        finally:
            self.finish_leaf(leaf)
        if retry and got.stderr.startswith(b"nsenter: ") and got.returncode == 1 and not self.alive():
            # The init died between our liveness check and nsenter (e.g. after `kill -9 -1`): the command never
            # started, so starting a new init and running it once more is safe.
            return self.exec(cmd, timeout_s, cwd, env, stdin, max_output_bytes, retry=False)
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
