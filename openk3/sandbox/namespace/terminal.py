"""A terminal in a sandbox: a pty pair of the sandbox's own devpts, and a command whose controlling terminal it is.

Why the sandbox's devpts: bwrap mounts a new devpts instance on the sandbox's /dev/pts, so a pty allocated there is named
/dev/pts/N inside the sandbox (`tty` finds it, and it counts against nothing of the host's own instance) and never appears
in the host's /dev/pts. The daemon opens that instance's `ptmx` under the init's root (`/proc/<init>/root`, checked against
the daemon's pidfd of the init once open) with openat2 RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS, checks
that what it got is the ptmx of a devpts (so no node the sandbox could plant elsewhere is used), and takes the slave with
TIOCGPTPEER rather than by its path: no name the sandbox controls is resolved on the host.

The command starts through openk3-enter like any exec (its own cgroup leaf, capabilities dropped, seccomp) with the slave as
stdin, stdout and stderr; `enter-tty` makes it the controlling terminal of the command's new session, so Ctrl-C (\\x03)
interrupts the foreground job and a resize (TIOCSWINSZ on the master) sends it SIGWINCH. The session is one unit: when the
command exits, is stopped or reaches its deadline, everything left in its leaf is killed (a terminal's jobs die with it, as
a hang-up would end them) and the master is closed.

Contract: `run` is called once, on the thread that owns the terminal; `write`, `resize` and `stop` may come from any thread.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import fcntl
import os
import select
import selectors
import signal
import stat
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Callable

from openk3.sandbox.linux.helper import HOST_ENV
from openk3.sandbox.linux.nonblocking import write_within
from openk3.sandbox.linux.proc import exit_status
from openk3.sandbox.linux.syscalls import LIBC, RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, openat2
from openk3.sandbox.namespace.instance import Instance
from openk3.sandbox.protocol import Conflict, SandboxError

TIOCSPTLCK = 0x40045431  # _IOW('T', 0x31, int): the same on x86_64 and aarch64
TIOCGPTPEER = 0x5441  # _IO('T', 0x41)
DEVPTS_SUPER_MAGIC = 0x1CD1
PTMX_DEVICE = (5, 2)
READ_CHUNK = 1 << 16
EXIT_GRACE_S = 0.5  # a hung-up terminal's helper is waited for this long before the session is killed
DRAIN_S = 1.0  # after the session's processes are gone, how long its last output may take to be read
LIBC.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]


@dataclasses.dataclass(frozen=True)
class Ended:
    exit_code: int  # the shell's convention: 128+N when killed by signal N
    timed_out: bool
    stopped: bool  # ended by `stop` (a kill, or its sandbox destroyed or restored)


def _fs_type(fd: int) -> int:
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first
    if LIBC.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(struct.unpack_from("l", buf.raw)[0])


def open_pair(init_pid: int, init_pidfd: int) -> tuple[int, int]:
    """(master, slave) of a new pty of the sandbox's devpts; the master is non-blocking, both close-on-exec."""
    root = os.open(f"/proc/{init_pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            # The descriptor is the init's root only if that init still exists now that it is open (a pid can be reused).
            signal.pidfd_send_signal(init_pidfd, 0)
        except ProcessLookupError as e:
            raise Conflict("the sandbox's init exited while a terminal was being opened; retry") from e
        flags = os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK
        master = openat2(root, "dev/pts/ptmx", flags, resolve=RESOLVE_IN_ROOT | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)
    finally:
        os.close(root)
    try:
        st = os.fstat(master)
        if not stat.S_ISCHR(st.st_mode) or (os.major(st.st_rdev), os.minor(st.st_rdev)) != PTMX_DEVICE or _fs_type(master) != DEVPTS_SUPER_MAGIC:
            raise SandboxError("the sandbox's /dev/pts/ptmx is not the ptmx of a devpts instance; refusing to use it")
        fcntl.ioctl(master, TIOCSPTLCK, struct.pack("i", 0))
        slave = fcntl.ioctl(master, TIOCGPTPEER, os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    except BaseException:
        os.close(master)
        raise
    return master, slave


class Terminal:
    def __init__(self, box: Instance, cmd: str | list[str], cwd: str | None, env: dict[str, str], rows: int, cols: int) -> None:
        self.box = box
        self.leaf = box.new_leaf()
        self.leaf_path = os.path.join(box.cg.control, self.leaf)
        self._lock = threading.Lock()
        self._closed = False
        # If the init is restarted between here and enter_argv (someone killed it), the pty belongs to the old init's devpts:
        # the command still gets a working terminal, only its /dev/pts/N is not in the new /dev/pts.
        pid, pidfd = box.ensure_init()
        try:
            self.master, slave = open_pair(pid, pidfd)
        finally:
            os.close(pidfd)
        try:
            self._set_size(rows, cols)  # before the command starts, so it reads its size at once
            argv, fds = box.enter_argv(self.leaf, cmd, cwd, env, tty=True)
            try:
                self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=HOST_ENV, pass_fds=fds, start_new_session=True)
            finally:
                for fd in fds:
                    os.close(fd)
        except BaseException:
            os.close(self.master)
            box.finish_leaf(self.leaf)
            raise
        finally:
            os.close(slave)  # the command's tree holds the only copies now, so the master reads EIO once they are gone
        self._wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)

    def _set_size(self, rows: int, cols: int) -> None:
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def resize(self, rows: int, cols: int) -> None:
        with self._lock:
            if self._closed:
                raise Conflict("the terminal has ended")
            self._set_size(rows, cols)

    def write(self, data: bytes, timeout_s: float) -> int:
        """Type `data` into the terminal; returns how much went in before `timeout_s` (all of it unless the command stopped
        reading and the terminal's input queue is full)."""
        with self._lock:
            if self._closed:
                raise Conflict("the terminal has ended")
            fd = os.dup(self.master)  # our own reference: `run` may close the master meanwhile
        try:
            return write_within(fd, data, timeout_s)
        except OSError as e:
            if e.errno == errno.EIO:
                raise Conflict("the terminal has ended (its command and every holder of it exited)") from e
            raise
        finally:
            os.close(fd)

    def stop(self) -> None:
        """End the session now (from any thread); `run` returns soon after with `stopped`."""
        with self._lock:
            if not self._closed:
                os.eventfd_write(self._wake, 1)

    def _read(self, on_output: Callable[[bytes], None]) -> bool:
        """Hand what the master has to `on_output`; False once the terminal is hung up (no process holds the slave)."""
        try:
            chunk = os.read(self.master, READ_CHUNK)
        except BlockingIOError:
            return True
        except OSError as e:
            if e.errno == errno.EIO:
                return False
            raise
        if chunk:
            on_output(chunk)
        return bool(chunk)

    def run(self, on_output: Callable[[bytes], None], timeout_s: float) -> Ended:
        """Copy the output to `on_output` until the command exits, `stop` is called or `timeout_s` passes; then kill what
        is left of the session, hand over its last output and close the terminal (also when this raises)."""
        deadline = time.monotonic() + timeout_s
        timed_out = stopped = False
        try:
            helper = os.pidfd_open(self.proc.pid)  # our unreaped child: the pid cannot have been reused
            try:
                timed_out, stopped = self._copy(helper, on_output, deadline)
            finally:
                os.close(helper)
        finally:
            # The helper first (until it has joined the leaf a cgroup kill misses it), then the session's whole tree. A
            # helper still running here has a command that outlived its terminal, a deadline or a stop: all end the session.
            if self.proc.poll() is None:
                self.proc.kill()
            self.box.cg.kill(self.leaf_path)
            returncode = self.proc.wait()
            self.box.cg.wait_empty(self.leaf_path, timeout_s=1.0)
            try:
                self._drain(on_output)
            finally:
                self.box.finish_leaf(self.leaf)
                with self._lock:
                    self._closed = True
                    os.close(self.master)
                    os.close(self._wake)
        return Ended(exit_code=exit_status(returncode), timed_out=timed_out, stopped=stopped)

    def _copy(self, helper: int, on_output: Callable[[bytes], None], deadline: float) -> tuple[bool, bool]:
        """The output loop of `run`; returns (timed_out, stopped)."""
        with selectors.DefaultSelector() as sel:
            for fd in (self.master, helper, self._wake):
                sel.register(fd, selectors.EVENT_READ)
            hung_up = False
            while not hung_up:
                left = deadline - time.monotonic()
                if left <= 0:
                    return True, False
                ready = {key.fd for key, _ in sel.select(left)}
                if self._wake in ready:
                    return False, True
                if self.master in ready:
                    hung_up = not self._read(on_output)
                if helper in ready:
                    return False, False
        # Hung up first: the command closed the terminal, usually by exiting, and its helper follows at once; give it that
        # moment so its exit status is its own rather than the kill's.
        select.select([helper], [], [], max(0.0, min(EXIT_GRACE_S, deadline - time.monotonic())))
        return False, False

    def _drain(self, on_output: Callable[[bytes], None]) -> None:
        """Output still queued in the pty once its processes are gone: read until the hang-up (EIO), within DRAIN_S."""
        deadline = time.monotonic() + DRAIN_S
        while time.monotonic() < deadline:
            if not self._read(on_output):
                return
            select.select([self.master], [], [], 0.01)
