"""Stateful shell sessions: one long-lived bash per session inside a sandbox, so `cd`, variables and functions persist.

Each command is sent as `{ cmd\n} </dev/null` followed by a printf of a random end marker and `$?` on stdout and the marker on
stderr; output is everything before the markers. On timeout the session's cgroup is frozen and every process but the bash
itself is killed, so the shell (and its state) survives a runaway command; if the command was a shell builtin loop that
cannot be killed separately, the whole session is killed and marked closed.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import threading
import time
import uuid

from openk3.sandbox.linux.helper import HOST_ENV
from openk3.sandbox.linux.proc import exit_status
from openk3.sandbox.namespace.instance import Instance
from openk3.sandbox.protocol import Conflict, ExecResult

KEEP_TAIL = 4096


class ShellSession:
    def __init__(self, box: Instance, cwd: str | None, env: dict[str, str]) -> None:
        self.box = box
        self.leaf = box.new_leaf()
        self.leaf_path = os.path.join(box.cg.control, self.leaf)
        argv, fds = box.enter_argv(self.leaf, ["/bin/bash", "--noprofile", "--norc"], cwd, env)
        try:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=HOST_ENV, pass_fds=fds, start_new_session=True
            )
        finally:
            for fd in fds:
                os.close(fd)
        self.lock = threading.Lock()
        self.closed = False

    def _shell_pids(self) -> frozenset[int]:
        """openk3-enter and the bash it forked: the two processes a timeout must spare."""
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
                return frozenset([self.proc.pid, *(int(p) for p in f.read().split())])
        except FileNotFoundError:
            return frozenset([self.proc.pid])

    def run(self, cmd: str, timeout_s: float, max_output_bytes: int) -> ExecResult:
        with self.lock:
            if self.closed or self.proc.poll() is not None:
                self.closed = True
                raise Conflict("shell session is closed (its shell exited or was killed by a timeout)")
            return self._run(cmd, timeout_s, max_output_bytes)

    def _run(self, cmd: str, timeout_s: float, max_output_bytes: int) -> ExecResult:
        assert self.proc.stdin and self.proc.stdout and self.proc.stderr
        marker = f"__openk3_end_{uuid.uuid4().hex}__".encode()
        start = time.monotonic()
        ooms = self.box.cg.oom_kills()
        script = b"{ " + cmd.encode() + b"\n} </dev/null\nprintf '%s %d\\n' " + marker + b" $?\nprintf '%s\\n' " + marker + b" >&2\n"
        self.proc.stdin.write(script)
        self.proc.stdin.flush()
        out, err = bytearray(), bytearray()
        bufs = {self.proc.stdout.fileno(): out, self.proc.stderr.fileno(): err}
        done = {fd: False for fd in bufs}
        deadline = start + timeout_s
        timed_out = False
        killed_all = False
        overflow = False
        with selectors.DefaultSelector() as sel:
            for fd in bufs:
                os.set_blocking(fd, False)
                sel.register(fd, selectors.EVENT_READ)
            while not all(done.values()):
                now = time.monotonic()
                if now >= deadline:
                    if not timed_out:
                        timed_out = True
                        self.box.cg.kill(self.leaf_path, keep=self._shell_pids())
                        deadline = now + 0.2
                    else:
                        self.box.cg.kill(self.leaf_path)
                        killed_all = True
                        break
                for key, _ in sel.select(deadline - now):
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        done = dict.fromkeys(done, True)
                        break
                    buf = bufs[key.fd]
                    buf += chunk
                    if len(buf) > max_output_bytes + KEEP_TAIL:
                        # Keep the head the caller gets and a tail long enough to still find the end marker.
                        del buf[max_output_bytes : len(buf) - KEEP_TAIL]
                        overflow = True
                    done[key.fd] = marker in buf
        if killed_all or self.proc.poll() is not None:
            self.close()
        code = 137
        if marker in out:
            idx = out.index(marker)
            tail = bytes(out[idx + len(marker) :]).split()
            code = int(tail[0]) if tail else 137
            del out[idx:]
        if marker in err:
            del err[err.index(marker) :]
        truncated = overflow or len(out) > max_output_bytes or len(err) > max_output_bytes
        return ExecResult(
            exit_code=exit_status(code),
            stdout=bytes(out[:max_output_bytes]),
            stderr=bytes(err[:max_output_bytes]),
            timed_out=timed_out,
            oom_killed=self.box.cg.oom_kills() > ooms,
            duration_ms=(time.monotonic() - start) * 1000,
            truncated=truncated,
        )

    def close(self) -> None:
        if self.proc.returncode is not None and self.closed:
            return
        self.closed = True
        # The helper first: until it has joined the leaf a cgroup kill misses it (and the shell it would then start); once
        # killed it forks nothing more, and whatever it forked before is in the leaf.
        self.proc.kill()
        self.box.cg.kill(self.leaf_path)
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if f is not None and not f.closed:
                try:
                    f.close()
                except BrokenPipeError:
                    pass
        self.box.cg.wait_empty(self.leaf_path, timeout_s=1.0)
        self.box.finish_leaf(self.leaf)
