"""The rank heartbeat: every rank of a multi-rank group proves it is alive, off the step path, every `interval_s`.

Why: a stalled rank (SIGSTOP, a hung host) leaves the others inside a step's collective until the group's timeout
(`ep_timeout_s`, minutes, since a long prefill is a legitimate wait), and an idle worker waits for the next step for days;
meanwhile rank 0 admits requests into a group that cannot serve them. So each rank runs a daemon thread that all-reduces
one integer with every other rank, on a gloo group of its own whose timeout is `timeout_s` (seconds). Liveness, not
progress: a rank busy in a long step still beats (torch releases the GIL inside kernels), a stopped or dead one does not,
and the others' round then fails -- at once for a dead peer (its sockets close), within `timeout_s` for a stopped one.
The thread then calls the owner's `on_lost` callbacks with the error: rank 0 declares its engine dead (the front end
answers every caller at once) and exits; a worker, whose main thread may be stuck in a collective with the lost rank,
exits at once (`exit_worker`), so the group is gone within `timeout_s` plus the exit.

Stopping is agreed too: the integer is a stop flag (MAX over the ranks), so when rank 0 closes the group every rank's
thread leaves in the same round and none mistakes the others' silence for a failure.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

log = logging.getLogger("openk3.parallel.serving")

HEARTBEAT_INTERVAL_S = 1.0


class RankLostError(RuntimeError):
    """A rank of the group stopped answering its heartbeat (stalled or dead)."""


class RankHeartbeat:
    """This rank's heartbeat thread. Construct it on every rank of the world in the same order relative to other groups
    (group creation is collective), then `start`; `stop` on rank 0 ends every rank's thread in the next round."""

    def __init__(self, rank: int, timeout_s: float, interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        if not 0 < interval_s < timeout_s:
            raise ValueError(f"RankHeartbeat: interval_s={interval_s:g}, timeout_s={timeout_s:g}: need 0 < interval < timeout")
        self.rank, self.interval_s, self.timeout_s = rank, interval_s, timeout_s
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.lost: RankLostError | None = None
        self._callbacks: list[Callable[[RankLostError], None]] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"openk3-heartbeat{rank}", daemon=True)

    def start(self) -> RankHeartbeat:
        self._thread.start()
        return self

    def on_lost(self, callback: Callable[[RankLostError], None]) -> None:
        """Call `callback(error)` on the heartbeat thread once a rank is lost (at once if one already is)."""
        with self._lock:
            lost = self.lost
            if lost is None:
                self._callbacks.append(callback)
        if lost is not None:
            callback(lost)

    def stop(self) -> None:
        """End the heartbeat on every rank (rank 0, before it releases the workers); returns within about one round."""
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.interval_s + self.timeout_s)

    def _run(self) -> None:
        while True:
            flag = torch.tensor([1 if self._stopping.is_set() else 0], dtype=torch.int64)
            try:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            except Exception as e:  # a peer stopped (timeout) or died (closed sockets)
                if not self._stopping.is_set():  # a rank leaving on its own while the others never beat is no loss
                    self._lose(e)
                return
            if int(flag.item()):
                return  # every rank saw the stop flag in this round
            self._stopping.wait(self.interval_s)

    def _lose(self, error: Exception) -> None:
        cause = f"{type(error).__name__}: {error}"
        lost = RankLostError(f"rank {self.rank}: a rank of the group stopped answering its heartbeat (timeout {self.timeout_s:g} s: {cause})")
        with self._lock:
            self.lost = lost
            callbacks, self._callbacks = self._callbacks, []
        log.error("%s", lost)
        for callback in callbacks:
            callback(lost)


def exit_worker(error: RankLostError) -> None:
    """A worker's reaction to a lost rank: leave now. Its main thread may wait in a collective with the lost rank for the
    group's whole timeout, and a worker holds nothing worth saving (rank 0 owns every request)."""
    print(f"openk3: {error}; this worker exits", file=sys.stderr, flush=True)
    os._exit(1)


def exit_after(grace_s: float, code: int = 1) -> Callable[[RankLostError], None]:
    """Rank 0 of `openk3 serve`: after a lost rank the server stops on its own (the engine is declared dead), but leaving
    the process group may block on the engine thread's pending collective; past `grace_s` the process exits regardless."""

    def arm(error: RankLostError) -> None:
        timer = threading.Timer(grace_s, lambda: (print(f"openk3: {error}; exiting", file=sys.stderr, flush=True), os._exit(code)))
        timer.daemon = True
        timer.start()

    return arm
