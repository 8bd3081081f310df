"""`torchrun --nproc-per-node N -m openk3 serve --ep N` (or `--tp N`, or `--dp N --ep N`): one process per rank; rank 0
serves and drives, the others follow.

Every rank joins the group torchrun describes (launch.init_from_env), then rank 0 runs the caller's `rank0` (the HTTP
server, whose engine drives the workers: an EPDriver, ranks.start_driver, or a DataParallelEngine, dp_ranks.py) and the
others run the caller's `worker` (ranks.run_worker_rank, dp_ranks.run_dp_worker_rank) until rank 0 stops them.

Shutdown comes from rank 0 only: SIGINT/SIGTERM stop rank 0's server, then its driver sends STOP. The workers let those
signals pass (torchrun forwards them to every rank) and keep running the steps of the requests rank 0 is still draining,
so no rank waits in a collective for a rank that already left.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from openk3.parallel.group import ParallelContext
from openk3.parallel.launch import init_from_env

log = logging.getLogger("openk3.parallel.serving")


def serve_ranks(
    size: int,
    device: str,
    rank0: Callable[[ParallelContext], int],
    worker: Callable[[ParallelContext], int],
    prog: str,
    threads: int | None = None,
    timeout_s: float = 300.0,
) -> int:
    """Run this process's rank; returns 2 when it could not join a group, else leaves the process with rank 0's exit code
    on rank 0 (`rank0(ctx)`), 0 on a worker (`worker(ctx)`, returning the steps it ran) that stopped cleanly. `timeout_s`
    bounds each collective (a rank that stalls or dies fails the step within it, rank 0's server then exits non-zero and
    the supervisor restarts the group)."""
    try:
        ctx = init_from_env(device, datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        print(f"{prog}: {size} ranks (--tp/--ep/--dp) run one process per rank: {e}", file=sys.stderr)
        return 2
    rc = 0
    try:
        if ctx.world_size != size:
            print(f"{prog}: --tp/--ep/--dp ask for {size} ranks but torchrun started {ctx.world_size}; use --nproc-per-node {size}", file=sys.stderr)
            rc = 2
        elif ctx.rank != 0:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda num, _frame: log.info("rank %d: signal %d, waiting for rank 0 to stop the workers", ctx.rank, num))
            if threads is not None:
                torch.set_num_threads(threads)
            steps = worker(ctx)
            log.info("rank %d: stopped after %d steps", ctx.rank, steps)
        else:
            rc = rank0(ctx)
    finally:
        dist.destroy_process_group()
    # gloo's threads can abort the interpreter during C++ static destruction at exit (seen with torchrun, about one run in
    # three); everything is flushed and the group is gone, so leave without running destructors
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
