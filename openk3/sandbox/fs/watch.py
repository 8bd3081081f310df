"""TreeWatch: inotify watches on a directory tree of a sandbox, opened host-side only through openat2 inside its root.

The watched directory is opened with RESOLVE_IN_ROOT relative to the sandbox's merged root, like read_file (a sandbox
symlink to /etc is the sandbox's /etc), and known by its inode from then on; every subdirectory is opened beneath it
with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV, so symlinked directories are not followed and nothing outside
the tree is ever watched. A watch is on inodes, not names: a sandbox that swaps the watched directory for a symlink to a
host path gets a move_self (the watch ends), never the host's events. The merged root is the same overlay superblock the
sandbox writes through, so its processes' changes are seen (not those under its own /proc, /dev or /dev/shm mounts).

Like `inotifywait -r`, a directory created inside the tree is watched from when its create event is read: what is made in
it before that is not reported. Directory renames inside the tree keep their watches (paths are rewritten); a directory
moved out loses them. At most `max_dirs` directories are watched; the first one left out is reported once ("watch_limit").

Contract: one thread (the owner's) calls `events`; `close` after it has stopped.
"""

from __future__ import annotations

import os
import posixpath

from openk3.sandbox.linux import inotify
from openk3.sandbox.linux.syscalls import RESOLVE_BENEATH, RESOLVE_IN_ROOT, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, RESOLVE_NO_XDEV, openat2
from openk3.sandbox.protocol import InvalidArgument, NotFound
from openk3.sandbox.protocol_interactive import WatchEvent

MASK = (
    inotify.IN_CREATE
    | inotify.IN_MODIFY
    | inotify.IN_ATTRIB
    | inotify.IN_DELETE
    | inotify.IN_MOVED_FROM
    | inotify.IN_MOVED_TO
    | inotify.IN_DELETE_SELF
    | inotify.IN_MOVE_SELF
    | inotify.IN_EXCL_UNLINK
)
BENEATH = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
KINDS = (
    (inotify.IN_CREATE, "create"),
    (inotify.IN_MODIFY, "modify"),
    (inotify.IN_ATTRIB, "attrib"),
    (inotify.IN_DELETE, "delete"),
    (inotify.IN_MOVED_FROM, "moved_from"),
    (inotify.IN_MOVED_TO, "moved_to"),
)


def check_path(path: str) -> str:
    """The absolute sandbox path to watch, normalised; relative paths, NUL and `..` components are refused."""
    if not path.startswith("/") or "\0" in path or ".." in path.split("/"):
        raise InvalidArgument(f"path={path!r}: expected an absolute path inside the sandbox, without NUL or '..' components")
    return posixpath.normpath(path).replace("//", "/")


class TreeWatch:
    def __init__(self, root: str, path: str, recursive: bool, max_dirs: int) -> None:
        self.path = check_path(path)
        self.recursive = recursive
        self.max_dirs = max_dirs
        self.ended: str | None = None  # why no event can follow any more
        self._limit_reported = False
        # The sandbox's root is held, not the watched directory: an open descriptor of a directory keeps its dentry, and
        # the kernel sends IN_DELETE_SELF only once the last one goes, so holding it would hide the directory's removal.
        self.rootfd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            top = self._open_path()
        except FileNotFoundError as e:
            os.close(self.rootfd)
            raise NotFound(f"path={path!r}: no such directory in the sandbox") from e
        except OSError as e:
            os.close(self.rootfd)
            raise InvalidArgument(f"path={path!r}: {e.strerror}") from e
        st = os.fstat(top)
        os.close(top)
        self.identity = (st.st_dev, st.st_ino)  # the directory watched, whatever name it has later
        try:
            self.inotify = inotify.Inotify()
        except BaseException:
            os.close(self.rootfd)
            raise
        self._paths: dict[int, bytes] = {}  # watch descriptor -> path below the watched directory (b"" for itself)
        try:
            self._watch_tree(b"", [])
            if not self._paths:
                raise InvalidArgument(f"path={path!r}: the directory could not be watched (it went away, or max_dirs={max_dirs})")
        except BaseException:
            self.close()
            raise

    def _open_path(self) -> int:
        """The watched path as the sandbox resolves it now (its symlinks inside its root, like read_file)."""
        return openat2(self.rootfd, self.path.lstrip("/") or ".", os.O_PATH | os.O_DIRECTORY, resolve=RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)

    def _open_top(self) -> int | None:
        """The watched directory, if its path still leads to it (it may have been moved, or replaced by another)."""
        try:
            fd = self._open_path()
        except OSError:
            return None
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self.identity:
            os.close(fd)
            return None
        return fd

    @property
    def fileno(self) -> int:
        return self.inotify.fd

    def _display(self, rel: bytes) -> str:
        name = rel.decode("utf-8", "backslashreplace")
        return self.path if not name else posixpath.join(self.path, name)

    def _watch_tree(self, rel: bytes, out: list[WatchEvent]) -> None:
        """Watch `rel` and, when recursive, every directory below it (not through symlinks)."""
        top = self._open_top()
        if top is None:
            return  # the watched directory left its path: its own move_self or delete_self follows
        try:
            self._watch_below(top, rel, out)
        finally:
            os.close(top)

    def _watch_below(self, top: int, rel: bytes, out: list[WatchEvent]) -> None:
        pending = [rel]
        while pending:
            here = pending.pop()
            if len(self._paths) >= self.max_dirs:
                self._report_limit(here, out)
                return
            try:
                fd = openat2(top, here or ".", os.O_RDONLY | os.O_DIRECTORY, resolve=BENEATH)
            except OSError:
                continue  # gone again, or replaced by a symlink or a file: nothing to watch there
            try:
                try:
                    self._paths[self.inotify.add(fd, MASK)] = here
                except inotify.WatchLimit:
                    self._report_limit(here, out)
                    return
                if self.recursive:
                    with os.scandir(fd) as entries:
                        pending += [posixpath.join(here, os.fsencode(e.name)) for e in entries if e.is_dir(follow_symlinks=False)]
            finally:
                os.close(fd)

    def _report_limit(self, rel: bytes, out: list[WatchEvent]) -> None:
        if not self._limit_reported:
            self._limit_reported = True
            out.append(WatchEvent("watch_limit", self._display(rel), True, 0))

    def _unwatch_tree(self, rel: bytes) -> None:
        for wd, here in list(self._paths.items()):
            if here == rel or here.startswith(rel + b"/"):
                del self._paths[wd]
                self.inotify.remove(wd)

    def _rename_tree(self, old: bytes, new: bytes) -> None:
        for wd, here in self._paths.items():
            if here == old or here.startswith(old + b"/"):
                self._paths[wd] = new + here[len(old) :]

    def events(self) -> list[WatchEvent]:
        """What inotify has queued now, as events of the sandbox's paths; sets `ended` when the watch can see no more."""
        out: list[WatchEvent] = []
        moved_out: dict[int, bytes] = {}  # cookie -> directory moved from, until its moved_to shows where it went
        for ev in self.inotify.read():
            if ev.mask & inotify.IN_Q_OVERFLOW:
                out.append(WatchEvent("overflow", "", False, 0))
                continue
            here = self._paths.get(ev.wd)
            if here is None:
                continue  # a watch removed since (its directory moved out of the tree)
            if ev.mask & inotify.IN_UNMOUNT:
                self.ended = "the sandbox's file system was unmounted"
            elif ev.mask & inotify.IN_IGNORED:
                del self._paths[ev.wd]
                if not here:
                    self.ended = self.ended or "the watched directory is gone"
            elif ev.mask & (inotify.IN_DELETE_SELF | inotify.IN_MOVE_SELF):
                if not here:  # a subdirectory's own events repeat its parent's delete or move
                    gone = "delete_self" if ev.mask & inotify.IN_DELETE_SELF else "move_self"
                    out.append(WatchEvent(gone, self.path, True, 0))
                    self.ended = f"the watched directory {self.path} was {'deleted' if gone == 'delete_self' else 'moved'}"
            else:
                self._changed(ev, here, out, moved_out)
        for rel in moved_out.values():
            self._unwatch_tree(rel)
        return out

    def _changed(self, ev: inotify.Event, here: bytes, out: list[WatchEvent], moved_out: dict[int, bytes]) -> None:
        rel = posixpath.join(here, ev.name) if here else ev.name
        is_dir = bool(ev.mask & inotify.IN_ISDIR)
        kind = next((name for bit, name in KINDS if ev.mask & bit), None)
        if kind is None:
            return
        if is_dir and self.recursive:
            # Watched before the event is queued: a caller that sees "create d" may count on changes inside d being seen.
            if kind == "create":
                self._watch_tree(rel, out)
            elif kind == "moved_from":
                moved_out[ev.cookie] = rel
            elif kind == "moved_to" and ev.cookie in moved_out:
                self._rename_tree(moved_out.pop(ev.cookie), rel)
            elif kind == "moved_to":
                self._watch_tree(rel, out)
        out.append(WatchEvent(kind, self._display(rel), is_dir, ev.cookie))

    def close(self) -> None:
        self.inotify.close()
        os.close(self.rootfd)
