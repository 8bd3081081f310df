"""Cgroup limits, freeze and kill on cgroup v1, v2 and hybrid hosts.

Each job picks the hierarchy that can do it: a limit (memory, pids, cpu) lives in v2 when the v2 tree has that controller,
otherwise in its v1 hierarchy; freeze and kill live in v2 whenever a v2 tree is mounted (cgroup.freeze and cgroup.kill are core
files that need no controller), otherwise in the v1 freezer. A sandbox gets one directory per hierarchy it uses; in the control
hierarchy (the one that freezes and kills) it also gets leaf children, `init` for its init and `x<n>` per exec or shell, so
a timeout can kill one command's whole tree (setsid, nohup and double-forks included) and leave the sandbox alive.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

LIMIT_CONTROLLERS = ("memory", "pids", "cpu")


@dataclasses.dataclass(frozen=True)
class Layout:
    v2_root: str | None  # mount point of the unified hierarchy, if any
    v2_controllers: frozenset[str]
    v1_roots: dict[str, str]  # controller -> mount point of its v1 hierarchy

    @property
    def name(self) -> str:
        if self.v2_root and not self.v1_roots:
            return "v2"
        return "hybrid" if self.v2_root else "v1"

    def limit_root(self, controller: str) -> str | None:
        if self.v2_root and controller in self.v2_controllers:
            return self.v2_root
        return self.v1_roots.get(controller)

    @property
    def control_root(self) -> str | None:
        return self.v2_root or self.v1_roots.get("freezer")


def detect_layout(mountinfo: str | None = None, v2_controllers: str | None = None) -> Layout:
    """This host's cgroup layout from /proc/self/mountinfo (or the given text, for tests of other layouts)."""
    if mountinfo is None:
        with open("/proc/self/mountinfo") as f:
            mountinfo = f.read()
    v2_root = None
    v1: dict[str, str] = {}
    for line in mountinfo.splitlines():
        left, right = line.split(" - ", 1)
        point = left.split()[4]
        fstype, _source, options = right.split()[:3]
        if fstype == "cgroup2" and v2_root is None:
            v2_root = point
        elif fstype == "cgroup":
            for opt in options.split(","):
                if opt in ("memory", "pids", "cpu", "cpuacct", "freezer"):
                    v1.setdefault(opt, point)
    if v2_root and v2_controllers is None:
        with open(os.path.join(v2_root, "cgroup.controllers")) as f:
            v2_controllers = f.read()
    return Layout(v2_root=v2_root, v2_controllers=frozenset((v2_controllers or "").split()), v1_roots=v1)


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _keyed(path: str, key: str) -> int | None:
    try:
        for line in _read(path).splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except FileNotFoundError:
        return None
    return None


class CgroupSet:
    """The cgroup directories of one sandbox. `prefix` is the daemon's own subtree, e.g. "openk3/<instance>"."""

    def __init__(self, layout: Layout, prefix: str, name: str) -> None:
        if layout.control_root is None:
            raise OSError("no cgroup v2 tree and no v1 freezer: cannot freeze or kill sandboxes")
        self.layout = layout
        self.control = os.path.join(layout.control_root, prefix, name)
        self.limit_dirs = {c: os.path.join(r, prefix, name) for c in LIMIT_CONTROLLERS if (r := layout.limit_root(c))}
        self.v2 = layout.v2_root is not None
        for d in self.all_dirs():
            os.makedirs(d, exist_ok=True)
        if self.v2:
            self._enable_v2_controllers(prefix)

    def _enable_v2_controllers(self, prefix: str) -> None:
        # v2 limits need the controller enabled in every ancestor's subtree_control (root included).
        wanted = [c for c in LIMIT_CONTROLLERS if c in self.layout.v2_controllers]
        if not wanted:
            return
        parts = [""] + prefix.split("/")
        path = self.layout.v2_root or ""
        for part in parts:
            path = os.path.join(path, part) if part else path
            current = set(_read(os.path.join(path, "cgroup.subtree_control")).split())
            missing = [c for c in wanted if c not in current]
            if missing:
                _write(os.path.join(path, "cgroup.subtree_control"), " ".join("+" + c for c in missing))

    def all_dirs(self) -> list[str]:
        return sorted({self.control, *self.limit_dirs.values()})

    def set_limits(self, memory_bytes: int | None, pids: int | None, cpus: float | None) -> None:
        mem = self.limit_dirs.get("memory")
        if memory_bytes is not None and mem:
            if mem.startswith(self.layout.v2_root or "\0"):
                _write(f"{mem}/memory.max", str(memory_bytes))
                if os.path.exists(f"{mem}/memory.swap.max"):
                    _write(f"{mem}/memory.swap.max", "0")
            else:
                _write(f"{mem}/memory.limit_in_bytes", str(memory_bytes))
                if os.path.exists(f"{mem}/memory.memsw.limit_in_bytes"):
                    _write(f"{mem}/memory.memsw.limit_in_bytes", str(memory_bytes))
        if pids is not None and (p := self.limit_dirs.get("pids")):
            _write(f"{p}/pids.max", str(pids))
        if cpus is not None and (c := self.limit_dirs.get("cpu")):
            period = 100_000
            quota = max(1000, int(cpus * period))
            if c.startswith(self.layout.v2_root or "\0"):
                _write(f"{c}/cpu.max", f"{quota} {period}")
            else:
                _write(f"{c}/cpu.cfs_period_us", str(period))
                _write(f"{c}/cpu.cfs_quota_us", str(quota))

    def child(self, leaf: str) -> str:
        path = os.path.join(self.control, leaf)
        os.makedirs(path, exist_ok=True)
        return path

    def procs_files(self, leaf: str) -> list[str]:
        """cgroup.procs files a new process of this sandbox must join: each limit dir plus the control leaf."""
        files = [os.path.join(d, "cgroup.procs") for d in self.limit_dirs.values() if d != self.control]
        return sorted(set(files)) + [os.path.join(self.child(leaf), "cgroup.procs")]

    def pids(self, path: str | None = None) -> list[int]:
        return pids_under(path or self.control)

    def freeze(self, path: str | None = None, frozen: bool = True) -> None:
        freeze(path or self.control, self.v2, frozen)

    def kill(self, path: str | None = None, keep: frozenset[int] = frozenset()) -> None:
        """SIGKILL every process under `path` (default: the whole sandbox) except `keep`; forks cannot escape."""
        kill_under(path or self.control, self.v2, keep)

    def wait_empty(self, path: str | None = None, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.pids(path):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)
        return True

    def remove_child(self, leaf: str) -> bool:
        try:
            os.rmdir(os.path.join(self.control, leaf))
            return True
        except FileNotFoundError:
            return True
        except OSError:
            return False

    def remove(self) -> None:
        for d in self.all_dirs():
            for dirpath, _dirs, _files in sorted(os.walk(d), key=lambda t: -len(t[0])):
                os.rmdir(dirpath)

    def oom_kills(self) -> int:
        mem = self.limit_dirs.get("memory")
        if not mem:
            return 0
        return (
            _keyed(f"{mem}/memory.events", "oom_kill") if mem.startswith(self.layout.v2_root or "\0") else _keyed(f"{mem}/memory.oom_control", "oom_kill")
        ) or 0

    def memory_bytes(self) -> int | None:
        mem = self.limit_dirs.get("memory")
        if not mem:
            return None
        name = "memory.current" if mem.startswith(self.layout.v2_root or "\0") else "memory.usage_in_bytes"
        return int(_read(f"{mem}/{name}"))

    def pid_count(self) -> int | None:
        p = self.limit_dirs.get("pids")
        return int(_read(f"{p}/pids.current")) if p else None

    def pids_refused(self) -> int | None:
        """How many forks the pids limit refused so far (pids.events "max", the same on v1 and v2)."""
        p = self.limit_dirs.get("pids")
        return _keyed(f"{p}/pids.events", "max") if p else None

    def cpu_usage_s(self) -> float | None:
        if self.v2:
            usec = _keyed(f"{self.control}/cpu.stat", "usage_usec")
            return None if usec is None else usec / 1e6
        return None


def pids_under(path: str) -> list[int]:
    found = []
    for dirpath, _dirs, _files in os.walk(path):
        try:
            found += [int(p) for p in _read(os.path.join(dirpath, "cgroup.procs")).split()]
        except FileNotFoundError:
            continue
    return found


def freeze(path: str, v2: bool, frozen: bool = True) -> None:
    if v2:
        _write(f"{path}/cgroup.freeze", "1" if frozen else "0")
        want = "frozen 1" if frozen else "frozen 0"
        deadline = time.monotonic() + 2.0
        while want not in _read(f"{path}/cgroup.events") and time.monotonic() < deadline:
            time.sleep(0.0002)
    else:
        _write(f"{path}/freezer.state", "FROZEN" if frozen else "THAWED")
        deadline = time.monotonic() + 2.0
        while frozen and _read(f"{path}/freezer.state").strip() != "FROZEN" and time.monotonic() < deadline:
            time.sleep(0.0002)


def kill_under(path: str, v2: bool, keep: frozenset[int] = frozenset()) -> None:
    """SIGKILL every process in the cgroup subtree at `path` except `keep` (a removed cgroup has none)."""
    if not os.path.isdir(path):
        return
    if v2 and not keep and os.path.exists(f"{path}/cgroup.kill"):
        _write(f"{path}/cgroup.kill", "1")
        return
    # Freeze first so nothing forks between listing and killing; SIGKILL is delivered when thawed.
    freeze(path, v2)
    try:
        for pid in pids_under(path):
            if pid not in keep:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    finally:
        if v2:
            freeze(path, v2, frozen=False)
        else:
            # A v1 cgroup frozen by itself (a sandbox frozen mid-snapshot when its daemon died) stays frozen when its parent
            # thaws (freezer.self_freezing), so its killed processes would never run to their death: thaw every level.
            for dirpath, _dirs, _files in os.walk(path):
                freeze(dirpath, v2, frozen=False)


def remove_tree(root: str) -> None:
    """rmdir a daemon's cgroup subtree in every hierarchy (children first); used at shutdown and crash recovery."""
    if not os.path.isdir(root):
        return
    for dirpath, _dirs, _files in sorted(os.walk(root), key=lambda t: -len(t[0])):
        try:
            os.rmdir(dirpath)
        except OSError:
            pass


def recover(layout: Layout, prefix: str) -> None:
    """Kill every process under a daemon's cgroup subtree and remove it in every hierarchy (crash recovery and shutdown)."""
    roots = {r for r in (layout.control_root, *layout.v1_roots.values()) if r}
    control = os.path.join(layout.control_root or "", prefix)
    if layout.control_root and os.path.isdir(control):
        kill_under(control, layout.v2_root is not None)
        deadline = time.monotonic() + 5.0
        while pids_under(control) and time.monotonic() < deadline:
            time.sleep(0.001)
    for root in roots:
        remove_tree(os.path.join(root, prefix))
        try:
            os.rmdir(os.path.join(root, os.path.dirname(prefix)))
        except OSError:
            pass  # another daemon instance still has sandboxes there
