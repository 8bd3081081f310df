"""The process topology of a multi-rank `openk3 serve` under torchrun: rank 0 builds the engine over the group and serves
HTTP, the other ranks run the worker side of the same spec until rank 0 releases them (openk3.parallel.serving)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import TYPE_CHECKING, Protocol

from openk3.launch.server import build_server, engine_spec, export_expert_load, serve_until_stopped, server_configs

if TYPE_CHECKING:
    from fastapi import FastAPI

    from openk3.parallel.group import ParallelContext
    from openk3.parallel.serving.heartbeat import RankHeartbeat


def run_expert_parallel(args: argparse.Namespace) -> int:
    """One rank of `torchrun --nproc-per-node N -m openk3 serve --ep N` (or `--tp N`; openk3.parallel.serving.torchrun):
    rank 0 serves HTTP and drives, the others follow."""
    from openk3.parallel.serving.ranks import run_worker_rank
    from openk3.parallel.serving.torchrun import serve_ranks

    engine, parallel = server_configs(args)
    spec = engine_spec(args, engine, parallel).rank_spec(collect_stats=True)
    rank0 = lambda ctx: _serve_rank0(args, ctx)  # noqa: E731
    worker = lambda ctx: run_worker_rank(ctx, spec)  # noqa: E731
    return serve_ranks(parallel.world_size, engine.device, rank0, worker, "openk3 serve", args.torch_threads, parallel.ep_timeout_s)


def run_data_parallel(args: argparse.Namespace) -> int:
    """One rank of `torchrun --nproc-per-node D -m openk3 serve --dp D --ep D`: every rank runs an engine of its own
    (scheduler, cache, prefix cache) and the MoE layers span them all; rank 0 serves HTTP, places each request on a rank
    (prefix-affine, else least-loaded: openk3.parallel.dp) and steps every rank's engine in lockstep."""
    import datetime

    from openk3.parallel.serving.dp_ranks import run_dp_worker_rank
    from openk3.parallel.serving.torchrun import serve_ranks

    engine, parallel = server_configs(args)
    spec = engine_spec(args, engine, parallel).rank_spec(collect_stats=True)
    # each rank's engine runs its model through a LockstepModel, whose weights the rank prepared at start-up
    engine = dataclasses.replace(engine, pack_cpu_weights=False)
    timeout = datetime.timedelta(seconds=parallel.ep_timeout_s)
    rank0 = lambda ctx: _serve_dp_rank0(args, ctx)  # noqa: E731
    worker = lambda ctx: run_dp_worker_rank(ctx, spec, engine, timeout)  # noqa: E731
    return serve_ranks(parallel.world_size, engine.device, rank0, worker, "openk3 serve", args.torch_threads, parallel.ep_timeout_s)


def _serve_dp_rank0(args: argparse.Namespace, ctx: ParallelContext) -> int:
    try:
        app = build_server(args, ctx)
    except (RuntimeError, ValueError) as e:  # a rank failed to start, or the server refused its settings
        print(f"openk3 serve: {e}", file=sys.stderr)
        return 2
    return _serve_then_release(app, args, app.state.rank_group, "a data-parallel")


def _keep_handlers_until_workers_stop(log: logging.Logger) -> None:
    """uvicorn re-raises the signal that stopped it once it has drained; with the default handlers SIGTERM would kill
    rank 0 there, before it releases the workers, so the handlers it falls back to only log."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda num, _frame: log.info("rank 0: signal %d, stopping the workers", num))


def _serve_rank0(args: argparse.Namespace, ctx: ParallelContext) -> int:
    try:
        app = build_server(args, ctx)
    except ValueError as e:
        print(f"openk3 serve: {e}", file=sys.stderr)
        return 2
    return _serve_then_release(app, args, app.state.rank_group, "an expert-parallel")


# After a lost rank rank 0's server stops on its own; leaving the group may then block on the engine thread's pending
# collective, so past this the process exits regardless (its supervisor restarts the group).
LOST_RANK_EXIT_GRACE_S = 10.0


class _RankGroup(Protocol):
    """What rank 0 drives the other ranks through: an EPDriver, or a DataParallelEngine."""

    @property
    def failed(self) -> bool: ...

    @property
    def heartbeat(self) -> RankHeartbeat | None: ...

    def close(self) -> None: ...


def _serve_then_release(app: FastAPI, args: argparse.Namespace, group: _RankGroup, kind: str) -> int:
    """Rank 0: serve until stopped, release the other ranks, write the expert load if asked; 1 when a step failed."""
    from openk3.parallel.serving.heartbeat import exit_after

    log = logging.getLogger("openk3.parallel.serving")
    _keep_handlers_until_workers_stop(log)
    heartbeat = group.heartbeat
    if heartbeat is not None:
        heartbeat.on_lost(app.state.served.frontend.fail)  # every caller answered 503 now, the server stops
        heartbeat.on_lost(exit_after(LOST_RANK_EXIT_GRACE_S))
    try:
        rc = serve_until_stopped(app, args)
    finally:
        # after a failed step this sends nothing (the workers are stuck in that step); destroying the group afterwards
        # closes the sockets they wait on, so they fail and exit instead of waiting out its timeout
        group.close()
    rc = export_expert_load(app, rc)
    if group.failed:
        log.error("rank 0: %s step failed; tearing the group down", kind)
        return 1
    return rc
