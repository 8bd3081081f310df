"""BackendConfig: where a host daemon keeps its state and how it runs sandboxes; validated when the backend starts."""

from __future__ import annotations

import dataclasses
import os
import socket

from openk3.sandbox.fs import rootfs
from openk3.sandbox.protocol import InvalidArgument


@dataclasses.dataclass(frozen=True)
class BackendConfig:
    state_dir: str = "/run/openk3-sandbox"
    cache_dir: str = dataclasses.field(default_factory=rootfs.default_cache_dir)
    store_bytes: int = 8 * 2**30
    max_layers: int = 32
    default_ttl_s: float = 3600.0
    # After a snapshot and after each restore, prepare one instance over that snapshot in the background (root mounted, init
    # running; see standby.py), so a restore or fork costs a swap instead of an init start. Costs one idle init per snapshot.
    prewarm: bool = True
    # Host uid (and gid) that a sandbox's root maps to. Not 0: a process that escaped its mount namespace would otherwise own
    # every root-owned host file. None runs sandboxes as host root (uid 0 mapped to 0), without capabilities either way.
    sandbox_uid: int | None = 100_000
    host: str = dataclasses.field(default_factory=socket.gethostname)
    # "auto" uses whatever the host mounts (see linux/cgroups.py); "v1" ignores a v2 tree and freezes/kills through the v1 freezer,
    # for hosts whose v2 tree is not writable (some containers), and to test that path on hybrid hosts.
    cgroups: str = "auto"

    def __post_init__(self) -> None:
        if self.store_bytes < 16 * 2**20:
            raise InvalidArgument(f"store_bytes={self.store_bytes}: expected >= 16 MiB")
        if not 2 <= self.max_layers <= 40:
            raise InvalidArgument(f"max_layers={self.max_layers}: expected 2..40 (all lowerdirs share one 4 KiB mount option string)")
        if self.default_ttl_s <= 0:
            raise InvalidArgument(f"default_ttl_s={self.default_ttl_s}: expected > 0")
        if self.sandbox_uid is not None and not 1 <= self.sandbox_uid < 2**32 - 1:
            raise InvalidArgument(f"sandbox_uid={self.sandbox_uid}: expected None (host root) or 1..2**32-2")
        if self.cgroups not in ("auto", "v1"):
            raise InvalidArgument(f"cgroups={self.cgroups!r}: expected 'auto' or 'v1'")
        if "@" in self.host or "/" in self.host:
            raise InvalidArgument(f"host={self.host!r}: expected a host name without '@' or '/' (it ends every id)")


def check_traversable(path: str, uid: int) -> None:
    """bwrap runs as the sandbox uid and resolves the root's path, so every ancestor of the state dir must let it pass."""
    parent = os.path.dirname(path)
    while True:
        st = os.stat(parent)
        if not (st.st_mode & 0o001 or st.st_uid == uid):
            raise InvalidArgument(
                f"state_dir={path!r}: ancestor {parent!r} (mode {oct(st.st_mode & 0o777)}) is not "
                f"traversable by sandbox_uid={uid}; pick a state dir under /run or /tmp, or set sandbox_uid=None"
            )
        if parent == "/":
            return
        parent = os.path.dirname(parent)
