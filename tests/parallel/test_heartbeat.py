"""Issue 36 item 2: the rank heartbeat finds a stopped (SIGSTOP) or dead (SIGKILL) rank within its timeout, off the step
path; a worker that loses rank 0 exits on its own; an agreed stop ends every rank's heartbeat and reports nothing.

Two real processes, because the faults are a process stopping and dying; the test waits on their reports (a queue) and
their exits, each bounded, never on a sleep."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch.multiprocessing as mp

from openk3.parallel.launch import free_port, join_group, rank_device
from openk3.parallel.serving.heartbeat import RankHeartbeat, exit_worker

TIMEOUT_S = 2.0
INTERVAL_S = 0.2
BOUND_S = 60.0  # a generous bound for a loaded CI machine; the measured detection is printed


def _rank(rank: int, port: int, queues: list[Any], stop_after_start: bool) -> None:
    """`queues[rank]` is this rank's own: a rank stopped inside a put holds only its own queue's lock."""
    import torch.distributed as dist

    reports = queues[rank]

    join_group(rank, 2, f"tcp://127.0.0.1:{port}", rank_device("cpu", rank))
    heartbeat = RankHeartbeat(rank, TIMEOUT_S, INTERVAL_S)
    if rank == 0:
        heartbeat.on_lost(lambda e: reports.put(("lost", time.monotonic(), str(e))))
    else:
        heartbeat.on_lost(exit_worker)
    heartbeat.start()
    reports.put(("started", rank, os.getpid()))
    if stop_after_start and rank == 0:
        heartbeat.stop()
        reports.put(("stopped", rank, heartbeat.lost is None))
    heartbeat._thread.join()  # the thread ends on a stop, or once it has reported the loss
    if heartbeat.lost is None:
        dist.destroy_process_group()
        reports.put(("stopped", rank, True))
    os._exit(0)


def _start(stop_after_start: bool = False) -> tuple[list[Any], Any]:
    spawn = mp.get_context("spawn")
    queues = [spawn.SimpleQueue() for _ in range(2)]
    port = free_port()
    procs = [spawn.Process(target=_rank, args=(r, port, queues, stop_after_start), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    assert [queues[r].get()[:2] for r in range(2)] == [("started", 0), ("started", 1)]
    return procs, queues


def _cleanup(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.join(BOUND_S)


@pytest.mark.distributed
def test_a_stopped_rank_is_found_within_the_heartbeat_timeout() -> None:
    procs, queues = _start()
    try:
        os.kill(procs[1].pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        kind, at, message = queues[0].get()
        assert kind == "lost" and "stopped answering its heartbeat (timeout 2 s" in message
        print(f"stopped rank found after {at - stopped_at:.1f} s (timeout {TIMEOUT_S} s)")
        assert at - stopped_at < BOUND_S
    finally:
        _cleanup(procs)


@pytest.mark.distributed
def test_a_dead_rank_0_makes_the_worker_exit_on_its_own() -> None:
    procs, _ = _start()
    try:
        killed_at = time.monotonic()
        procs[0].kill()
        procs[1].join(BOUND_S)
        assert procs[1].exitcode == 1, "the worker left on its own, with an error"
        print(f"worker exited {time.monotonic() - killed_at:.1f} s after rank 0 was killed")
    finally:
        _cleanup(procs)


@pytest.mark.distributed
def test_an_agreed_stop_ends_every_heartbeat_and_reports_nothing() -> None:
    procs, queues = _start(stop_after_start=True)
    try:
        for p in procs:
            p.join(BOUND_S)
        assert [p.exitcode for p in procs] == [0, 0]
        seen = []
        for q in queues:
            while not q.empty():
                seen.append(q.get())
        assert all(kind == "stopped" and ok for kind, _, ok in seen) and len(seen) >= 2
    finally:
        _cleanup(procs)
