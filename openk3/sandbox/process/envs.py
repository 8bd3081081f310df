"""Host side of process snapshots: Python-native environments run by fork servers (forkserver.py), one cgroup per family.

A family is a root environment process and everything forked from it (templates and live copies); its cgroup lets destroy kill
the whole family at once. Ids: environments "pe-...@host", process snapshots "psnap-...@host". Contract: methods are
thread-safe; calls to one environment are serialised by its lock.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid

from openk3.sandbox.linux.cgroups import CgroupSet, Layout
from openk3.sandbox.linux.helper import Helper
from openk3.sandbox.process import wire
from openk3.sandbox.process.registry import EnvFactories
from openk3.sandbox.protocol import InvalidArgument, NotFound, SandboxError, SnapshotInfo, SnapshotKind

PROCESS_CAPTURES = "memory of one Python environment process (fork of a frozen template); no files, sockets or other threads"
# The directory holding the `openk3` package (this file is openk3/sandbox/process/envs.py), so the fork server imports this copy.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


@dataclasses.dataclass(frozen=True)
class _Member:
    family: str
    sock: socket.socket
    pid: int
    lock: threading.Lock


class ProcessEnvs:
    def __init__(self, layout: Layout, cg_prefix: str, host: str, helper: Helper, factories: EnvFactories | None = None) -> None:
        self.layout = layout
        self.helper = helper
        self.factories = factories or EnvFactories()
        self.cg_prefix = cg_prefix
        self.host = host
        self._lock = threading.Lock()
        self._members: dict[str, _Member] = {}  # env ids and process-snapshot ids
        self._snapshots: dict[str, SnapshotInfo] = {}
        self._families: dict[str, tuple[CgroupSet, subprocess.Popen[bytes], set[str]]] = {}

    def _id(self, prefix: str) -> str:
        return f"{prefix}{uuid.uuid4().hex[:12]}@{self.host}"

    def _member(self, mid: str) -> _Member:
        with self._lock:
            if mid not in self._members:
                raise NotFound(f"id={mid!r}: no such process environment or process snapshot on host {self.host}")
            return self._members[mid]

    def create(self, factory: str, kwargs: dict | None = None, memory_bytes: int | None = None, timeout_s: float = 60.0) -> str:
        """Start a fork server that builds the registered factory `factory` with `kwargs` (see registry.py)."""
        spec = self.factories.resolve(factory)
        family = "pf" + uuid.uuid4().hex[:12]
        cg = CgroupSet(self.layout, self.cg_prefix, family)
        cg.set_limits(memory_bytes, None, None)
        host_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # The daemon's own environment: a fork server is operator code run as host root (registry.py); callers choose only kwargs.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([PACKAGE_PARENT, *self.factories.pythonpath]))
        server = [sys.executable, "-m", "openk3.sandbox.process.forkserver", spec, str(child_end.fileno())]
        argv = self.helper.spawn_argv(cg.procs_files("env"), None, server)
        # stderr goes to an anonymous file, not a pipe: nobody reads it after start-up, and a full pipe would block the env.
        with tempfile.TemporaryFile() as log:
            # Its own session, like every process the daemon starts: a signal to the daemon's group (Ctrl-C) is not its.
            proc = subprocess.Popen(argv, pass_fds=(child_end.fileno(),), env=env, stdin=subprocess.DEVNULL, stderr=log, start_new_session=True)
            child_end.close()
            host_end.settimeout(timeout_s)
            try:
                # The caller's kwargs go over the socket: a command line is readable by every host user.
                wire.send(host_end, {"kwargs": kwargs or {}})
                reply, _ = wire.recv(host_end)
            except (EOFError, TimeoutError, OSError) as e:
                proc.kill()
                proc.wait()
                log.seek(0)
                err = log.read().decode(errors="replace")[-2000:]
                cg.kill()
                cg.wait_empty()
                cg.remove()
                raise SandboxError(f"process environment {factory!r} failed to start: {err.strip() or e}") from e
        eid = self._id("pe-")
        with self._lock:
            self._families[family] = (cg, proc, {eid})
            self._members[eid] = _Member(family, host_end, int(reply["pid"]), threading.Lock())
        return eid

    def _request(self, member: _Member, message: dict, fds: list[int] | None = None, timeout_s: float = 60.0) -> dict:
        with member.lock:
            member.sock.settimeout(timeout_s)
            try:
                wire.send(member.sock, message, fds)
                reply, _ = wire.recv(member.sock)
            except (EOFError, TimeoutError, OSError) as e:
                raise SandboxError(f"process environment pid {member.pid} did not answer {message.get('op')!r}: {e}") from e
        if not reply.get("ok"):
            raise InvalidArgument(str(reply.get("error")))
        return reply

    def call(self, env_id: str, method: str, args: list | None = None, kwargs: dict | None = None, timeout_s: float = 60.0):
        if not env_id.startswith("pe-"):
            raise InvalidArgument(f"env_id={env_id!r}: calls go to environments (pe-...), not snapshots")
        msg = {"op": "call", "method": method, "args": list(args or []), "kwargs": dict(kwargs or {})}
        return self._request(self._member(env_id), msg, timeout_s=timeout_s)["result"]

    def _fork_from(self, parent: _Member, op: str, new_id: str) -> None:
        host_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            reply = self._request(parent, {"op": op, "seed": secrets.randbits(63)}, [child_end.fileno()])
        finally:
            child_end.close()
        if op == "spawn":
            host_end.settimeout(60.0)
            wire.recv(host_end)  # the copy's hello: it has reseeded and is serving
        with self._lock:
            self._members[new_id] = _Member(parent.family, host_end, int(reply["pid"]), threading.Lock())
            self._families[parent.family][2].add(new_id)

    def snapshot(self, env_id: str) -> SnapshotInfo:
        member = self._member(env_id)
        sid = self._id("psnap-")
        self._fork_from(member, "snapshot", sid)
        info = SnapshotInfo(snapshot_id=sid, kind=SnapshotKind.PROCESS, layers=(), source=env_id, created_at=time.time(), captures=PROCESS_CAPTURES)
        with self._lock:
            self._snapshots[sid] = info
        return info

    def spawn(self, snapshot_id: str) -> str:
        """A new live environment from a process snapshot (restore into a new id; fork(n) calls this n times)."""
        eid = self._id("pe-")
        self._fork_from(self._member(snapshot_id), "spawn", eid)
        return eid

    def restore(self, env_id: str, snapshot_id: str) -> None:
        """Replace the live process behind `env_id` by a fresh copy of the snapshot; the id stays the same."""
        fresh = self.spawn(snapshot_id)
        with self._lock:
            new = self._members.pop(fresh)
            old = self._members[env_id]
            self._families[new.family][2].discard(fresh)
            self._members[env_id] = _Member(new.family, new.sock, new.pid, old.lock)
            self._families[new.family][2].add(env_id)
        if old.family != new.family:
            self._families[old.family][2].discard(env_id)
        self._end(old)
        self._maybe_drop_family(old.family)

    def fork(self, source: str, n: int) -> list[str]:
        if not 1 <= n <= 1024:
            raise InvalidArgument(f"n={n}: expected 1..1024")
        if source.startswith("pe-"):
            snap = self.snapshot(source)
            try:
                return [self.spawn(snap.snapshot_id) for _ in range(n)]
            finally:
                self.delete(snap.snapshot_id)
        return [self.spawn(source) for _ in range(n)]

    def _end(self, member: _Member) -> None:
        """SIGKILL and wait until the process is gone (its memory unmapped), so the cost lands on destroy, not on the next fork."""
        try:
            pidfd = os.pidfd_open(member.pid)
        except ProcessLookupError:
            pidfd = None
        try:
            os.kill(member.pid, signal.SIGKILL)
            if pidfd is not None:
                select.select([pidfd], [], [], 5.0)
        except ProcessLookupError:
            pass
        finally:
            if pidfd is not None:
                os.close(pidfd)
        member.sock.close()

    def delete(self, mid: str) -> None:
        """Destroy an environment or delete a process snapshot (its template)."""
        with self._lock:
            member = self._members.pop(mid, None)
            self._snapshots.pop(mid, None)
            if member is not None:
                self._families[member.family][2].discard(mid)
        if member is None:
            raise NotFound(f"id={mid!r}: no such process environment or process snapshot on host {self.host}")
        self._end(member)
        self._maybe_drop_family(member.family)

    def _maybe_drop_family(self, family: str) -> None:
        with self._lock:
            entry = self._families.get(family)
            if entry is None or entry[2]:
                return
            del self._families[family]
        cg, proc, _ = entry
        cg.kill()
        proc.wait()
        cg.wait_empty()
        cg.remove()

    def snapshot_info(self, snapshot_id: str) -> SnapshotInfo:
        with self._lock:
            if snapshot_id not in self._snapshots:
                raise NotFound(f"snapshot_id={snapshot_id!r}: no such process snapshot on host {self.host}")
            return self._snapshots[snapshot_id]

    def ids(self) -> list[str]:
        with self._lock:
            return sorted(self._members)

    def close(self) -> None:
        for mid in self.ids():
            self.delete(mid)
