"""BackendConfig: where a host daemon keeps its state and how it runs sandboxes; validated when the backend starts."""

from __future__ import annotations

import dataclasses
import os
import socket

from openk3.sandbox.fs import rootfs
from openk3.sandbox.protocol import ArchiveLimits, InvalidArgument

DEFAULT_ARCHIVE_LIMITS = ArchiveLimits(max_bytes=1 << 30, max_members=200_000, max_member_bytes=1 << 30, max_path_bytes=4096, max_window_bytes=8 << 20)


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
    # At most this many standbys at once (each an idle init, a tmpfs, an overlay and cgroups); beyond it the one prepared
    # longest ago goes, so 100 live snapshots do not mean 100 idle sandboxes.
    max_standbys: int = 16
    # Host ids of sandboxes (uid and gid alike): `sandbox_uid` (B) owns the base rootfs and the layers on disk, and each live
    # sandbox runs as its own id from B+1..B+sandbox_uids-1 (namespace/uids.py), so per-uid kernel limits are per sandbox; at
    # most sandbox_uids-1 sandboxes and standbys live at once. Not 0: a process that escaped its mount namespace would
    # otherwise own every root-owned host file. The whole range must be nobody else's: no /etc/passwd user or group, no
    # /etc/subuid or /etc/subgid range (checked at start), since whoever holds such an id could reach sandbox files. None
    # runs sandboxes as host root (uid 0 mapped to 0): still without capabilities (bwrap --cap-drop ALL for the init,
    # openk3-enter for commands), but an escape from the mount namespace would then own the host's root-owned files.
    sandbox_uid: int | None = 100_000
    sandbox_uids: int = 65_536
    # Pseudo-terminals one sandbox may have open at once (the `max=` of its own devpts, linux/ptys.py): every sandbox draws
    # them from the host-wide kernel.pty.max (4096 by default, less kernel.pty.reserve), which no uid or namespace splits.
    sandbox_ptys: int = 64
    # How long an init may take to say it is up before its sandbox is killed and the call fails: after a restore the init
    # runs the sandbox's own files, which may never say it.
    init_timeout_s: float = 10.0
    host: str = dataclasses.field(default_factory=socket.gethostname)
    # "auto" uses whatever the host mounts (see linux/cgroups.py); "v1" ignores a v2 tree and freezes/kills through the v1 freezer,
    # for hosts whose v2 tree is not writable (some containers), and to test that path on hybrid hosts.
    cgroups: str = "auto"
    # Ceilings for every archive a caller sends or receives (upload_tar, download_tar, import_snapshot, export_snapshot's
    # receiver); a call may lower them, never raise them. See docs/sandbox.md, Transport.
    archive_limits: ArchiveLimits = dataclasses.field(default_factory=lambda: DEFAULT_ARCHIVE_LIMITS)

    def __post_init__(self) -> None:
        if self.store_bytes < 16 * 2**20:
            raise InvalidArgument(f"store_bytes={self.store_bytes}: expected >= 16 MiB")
        if not 2 <= self.max_layers <= 40:
            raise InvalidArgument(f"max_layers={self.max_layers}: expected 2..40 (all lowerdirs share one 4 KiB mount option string)")
        if not 0 <= self.max_standbys <= 4096:
            raise InvalidArgument(f"max_standbys={self.max_standbys}: expected 0..4096")
        if self.default_ttl_s <= 0:
            raise InvalidArgument(f"default_ttl_s={self.default_ttl_s}: expected > 0")
        if self.sandbox_uid is not None and not 1 <= self.sandbox_uid < 2**32 - 1:
            raise InvalidArgument(f"sandbox_uid={self.sandbox_uid}: expected None (host root) or 1..2**32-2")
        top = 2**32 - 1 - (self.sandbox_uid or 1)  # ids up to 2**32-2: (uid_t)-1 is no id
        if not 2 <= self.sandbox_uids <= top:
            raise InvalidArgument(
                f"sandbox_uids={self.sandbox_uids}: expected 2..{top} (ids sandbox_uid..sandbox_uid+sandbox_uids-1 below 2**32-1; "
                "one is the owner on disk, each other one a live sandbox)"
            )
        if not 0 <= self.sandbox_ptys <= 2**20:
            raise InvalidArgument(f"sandbox_ptys={self.sandbox_ptys}: expected 0..2**20 (the kernel's ceiling for one devpts)")
        if not 0 < self.init_timeout_s <= 600:
            raise InvalidArgument(f"init_timeout_s={self.init_timeout_s}: expected 0 < init_timeout_s <= 600")
        if self.cgroups not in ("auto", "v1"):
            raise InvalidArgument(f"cgroups={self.cgroups!r}: expected 'auto' or 'v1'")
        unset = [f.name for f in dataclasses.fields(self.archive_limits) if getattr(self.archive_limits, f.name) is None]
        if unset:
            raise InvalidArgument(f"archive_limits: {', '.join(unset)} must be set (the server's ceilings)")
        if "@" in self.host or "/" in self.host:
            raise InvalidArgument(f"host={self.host!r}: expected a host name without '@' or '/' (it ends every id)")


def check_traversable(path: str) -> None:
    """bwrap runs as a sandbox's own uid and resolves its root's path, so every ancestor of the state dir must let every
    uid of the pool pass: search permission for others (the dir itself is the daemon's, 0711)."""
    parent = os.path.dirname(path)
    while True:
        st = os.stat(parent)
        if not st.st_mode & 0o001:
            raise InvalidArgument(
                f"state_dir={path!r}: ancestor {parent!r} (mode {oct(st.st_mode & 0o777)}) is not traversable by the "
                "sandbox uids (expected search permission for others, o+x); pick a state dir under /run or /tmp, or set sandbox_uid=None"
            )
        if parent == "/":
            return
        parent = os.path.dirname(parent)


def _id_files(etc: str) -> list[tuple[str, list[str]]]:
    found = []
    for name in ("passwd", "group", "subuid", "subgid"):
        try:
            with open(os.path.join(etc, name)) as f:
                found.append((name, [line.strip() for line in f if line.strip() and not line.startswith("#")]))
        except FileNotFoundError:
            continue
    return found


def check_unshared_id(uid: int, count: int = 1, etc: str = "/etc") -> None:
    """Refuse sandbox ids uid..uid+count-1 if a host user or group has one, or a subordinate id range hands one out.

    Each sandbox's root is one of those ids (uid and gid) on the host, its dir is open to that group (instance.py), and the
    first owns every layer: a user with such an id, in such a group, or allowed to map one in a user namespace of their own
    (newuidmap) could read and change sandbox files.
    """
    end = uid + count
    for name, lines in _id_files(etc):
        for line in lines:
            fields = line.split(":")
            try:
                if name == "passwd" and any(uid <= int(i) < end for i in fields[2:4]):
                    hit = f"user {fields[0]!r} (uid {fields[2]}, gid {fields[3]})"
                elif name == "group" and uid <= int(fields[2]) < end:
                    hit = f"group {fields[0]!r} (gid {fields[2]})"
                elif name in ("subuid", "subgid") and int(fields[1]) < end and uid < int(fields[1]) + int(fields[2]):
                    hit = f"the range of {fields[0]!r} ({fields[1]}, {fields[2]} ids)"
                else:
                    continue
            except (IndexError, ValueError):
                continue  # a malformed line names no id
            raise InvalidArgument(
                f"sandbox_uid={uid}, sandbox_uids={count}: {os.path.join(etc, name)} gives ids of {uid}..{end - 1} to {hit}, who "
                "could then read and change sandbox files; pick a range no user, group or subordinate range uses (openk3 "
                "sandbox serve --sandbox-uid, --sandbox-uids)"
            )
