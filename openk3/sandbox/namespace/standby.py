"""Background work that takes instance start-up and teardown off the restore path.

Standbys: after a snapshot, and after each restore to it, the backend prepares one instance over that snapshot's layers (root
mounted, init running) in the background. The next restore to the snapshot, or the first child of a fork from it, adopts the
standby instead of starting an init, if it was built with the same limits, env and workdir; otherwise it is torn down.
Retirement: an instance being replaced is killed at once and unmounted in the background.

Bounds: at most `max_ready` standbys exist (each is an idle init, a tmpfs, an overlay and cgroups); preparing one more
drops the one prepared longest ago. A restore never waits behind other queued builds: a standby whose build has not
started yet is cancelled and the caller builds in line (as fast as the queued build would be, without the queue).

Contract: every background job is recorded under an owner (a sandbox or snapshot id); `wait(owner)` returns only when that
owner's jobs are done and its standby is gone, so destroy and delete_snapshot leave no mounts, cgroups or processes.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Hashable

from openk3.sandbox.namespace.instance import Instance

Release = Callable[[Instance], None]  # tears an instance down and gives back its layer references


class Standbys:
    def __init__(self, release: Release, workers: int = 2, max_ready: int = 16) -> None:
        self._release = release
        self.max_ready = max_ready
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox-bg")
        self._lock = threading.Lock()
        self._ready: dict[str, tuple[Hashable, concurrent.futures.Future[Instance]]] = {}  # snapshot id -> (params, build)
        self._jobs: dict[str, list[concurrent.futures.Future[None]]] = {}

    def _record(self, owner: str, job: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._jobs.setdefault(owner, []).append(job)

    def _release_when_built(self, owner: str, build: concurrent.futures.Future[Instance]) -> None:
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def release(f: concurrent.futures.Future[Instance]) -> None:
            try:
                if f.exception() is None:
                    self._release(f.result())
            finally:
                done.set_result(None)

        self._record(owner, done)
        build.add_done_callback(release)

    def _discard(self, owner: str, build: concurrent.futures.Future[Instance]) -> None:
        """A standby no one will take: never built if its build has not started, else torn down once built."""
        if not build.cancel():
            self._release_when_built(owner, build)

    def prepare(self, snapshot_id: str, params: Hashable, build: Callable[[], Instance]) -> None:
        """Start building a standby for `snapshot_id` (replacing an older one) unless a matching one is on its way; beyond
        `max_ready`, the standby prepared longest ago goes."""
        with self._lock:
            old = self._ready.get(snapshot_id)
            if old is not None and old[0] == params:
                return
            self._ready.pop(snapshot_id, None)  # re-inserted last: the dict's order is the eviction order
            self._ready[snapshot_id] = (params, self._pool.submit(build))
            evicted = []
            while len(self._ready) > self.max_ready:
                oldest = next(iter(self._ready))
                evicted.append((oldest, self._ready.pop(oldest)[1]))
        if old is not None:
            self._discard(snapshot_id, old[1])
        for owner, stale in evicted:
            self._discard(owner, stale)

    def take(self, snapshot_id: str, params: Hashable) -> Instance | None:
        """The standby for `snapshot_id` if it was built with `params` (waiting for its build); None otherwise."""
        with self._lock:
            entry = self._ready.pop(snapshot_id, None)
        if entry is None:
            return None
        if entry[0] != params or entry[1].cancel():
            # Another shape, or still queued behind other builds (now cancelled): the caller builds in line, without the queue.
            self._discard(snapshot_id, entry[1])
            return None
        try:
            return entry[1].result()
        except Exception:  # the background build failed; the caller builds in line and reports its error
            return None

    def retire(self, owner: str, box: Instance) -> None:
        """Kill `box`'s processes now, unmount and remove it in the background."""
        box.cg.kill()
        self._record(owner, self._pool.submit(self._release, box))

    def wait(self, owner: str) -> None:
        with self._lock:
            entry = self._ready.pop(owner, None)
        if entry is not None:
            self._discard(owner, entry[1])
        with self._lock:
            jobs = self._jobs.pop(owner, [])
        for job in jobs:
            job.result()

    def close(self) -> None:
        with self._lock:
            owners = set(self._ready) | set(self._jobs)
        for owner in owners:
            self.wait(owner)
        self._pool.shutdown(wait=True)
