"""`openk3 serve` (the OpenAI-compatible server) and `openk3 bench serve` (the load-generating benchmark client)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from openk3.api.engine_args import (
    add_engine_arguments,
    add_process_arguments,
    add_server_arguments,
    connection_settings,
    engine_configs,
    server_settings,
)

if TYPE_CHECKING:  # the CLI imports torch and the server lazily, so `openk3 plan` and `--help` stay fast
    from fastapi import FastAPI

    from openk3.launch.spec import EngineSpec
    from openk3.parallel.config import ParallelConfig
    from openk3.parallel.group import ParallelContext
    from openk3.parallel.serving.driver import EPTotals
    from openk3.serve.config import EngineConfig
    from openk3.serve.engine import ServedEngine


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("--model", default="tiny", help="preset name (tiny, debug) or checkpoint folder; default: the embedded demo model")
    p.add_argument("--served-model-name", default=None, help="the name clients use in 'model' (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("OPENK3_API_KEY"), help="require 'Authorization: Bearer KEY' on /v1 (env OPENK3_API_KEY)")
    add_engine_arguments(p)
    add_server_arguments(p)
    add_process_arguments(p)
    p.add_argument("--chat-template", type=Path, default=None, help="a Jinja chat template file (default: the model's own, else ChatML)")
    p.add_argument(
        "--tokenizer",
        choices=("auto", "byte"),
        default="auto",
        help="auto: the checkpoint's own (tokenizer.json or Kimi's tiktoken.model; a folder without one is an error); "
        "byte: the byte tokenizer, with the checkpoint's bos/eos ids",
    )
    p.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body accepted (larger: HTTP 413)")
    p.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads (default: torch's own choice)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get to finish on shutdown")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    _scale_cli().add_arguments(p)
    p.set_defaults(func=run)

    b = subparsers.add_parser("bench", help="benchmarks")
    bench_sub = b.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    from openk3.api.bench import add_arguments, run_cli

    bs = bench_sub.add_parser("serve", help="load an OpenAI-compatible server and report TTFT, TPOT, ITL, E2E latency, throughput, goodput")
    add_arguments(bs)
    bs.set_defaults(func=run_cli)


def build_server(args: argparse.Namespace, group: ParallelContext | None = None) -> FastAPI:
    """The FastAPI app for parsed `serve` arguments (also used by tests and benchmarks/serve.py).

    With `group` (rank 0 of a joined multi-rank group under torchrun) the engine's model is an EPDriver whose steps are
    broadcast to the worker ranks in run_worker_rank, or with --dp the engine is a DataParallelEngine over every rank's;
    `app.state.rank_group.close()` releases the other ranks."""
    import torch

    from openk3.launch.engine import build_engine

    config, parallel = server_configs(args)
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    built = build_engine(_engine_spec(args, config, parallel), group)
    try:
        app = _app(args, built.core, built.ep_totals)
        _record_expert_load(app, built.counted_model, parallel)
    except BaseException:
        if built.group is not None:
            built.group.close()
        raise
    if built.group is not None:
        app.state.rank_group = built.group
    return app


def _engine_spec(args: argparse.Namespace, config: EngineConfig, parallel: ParallelConfig) -> EngineSpec:
    from openk3.launch.spec import EngineSpec

    return EngineSpec(args.model, config, parallel, byte_tokenizer=args.tokenizer == "byte")


def _record_expert_load(app: FastAPI, model: Any, parallel: ParallelConfig) -> None:
    """--export-eplb-stats: count rank 0's routing (it sees every token) from now on; _export_expert_load writes it."""
    app.state.expert_load = None
    if parallel.export_eplb_stats is not None:
        from openk3.parallel.ep.load_stats import record_expert_load

        app.state.expert_load = record_expert_load(model, parallel.export_eplb_stats)  # after build_engine prepared the model


def _export_expert_load(app: FastAPI, rc: int) -> int:
    """After the server has drained (the engine thread has stopped): write the counted expert load; 1 if it cannot be."""
    recording = getattr(app.state, "expert_load", None)
    if recording is None:
        return rc
    log = logging.getLogger("openk3.api")
    try:
        recording.save()
    except OSError as e:
        log.error("could not write the expert load to %s: %s", recording.path, e)
        return 1
    return rc


def build_server_with_local_ranks(args: argparse.Namespace) -> tuple[FastAPI, Any]:
    """The app for `serve` flags with a multi-rank layout (--tp/--ep/--dp), its other ranks spawned on this machine as
    `LLM(tp=, ep=, dp=)` spawns them (launch/engine.py), instead of joining a torchrun group: what a Ray Serve
    replica of several ranks runs (openk3.scale). Returns the app and the LocalEP, whose close() stops those ranks."""
    import torch

    from openk3.launch.engine import build_engine

    config, parallel = server_configs(args)
    if parallel.world_size == 1:
        raise ValueError("build_server_with_local_ranks: the flags ask for one rank; use build_server")
    if parallel.export_eplb_stats is not None:
        raise ValueError("--export-eplb-stats with spawned ranks is not supported: export from one process or a torchrun server")
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    built = build_engine(_engine_spec(args, config, parallel))
    assert built.local_ranks is not None
    try:
        app = _app(args, built.core)
    except BaseException:
        built.local_ranks.close()
        raise
    return app, built.local_ranks


def server_configs(args: argparse.Namespace) -> tuple[EngineConfig, ParallelConfig]:
    """The engine and parallel settings of parsed `serve` flags. The server owns its model, so on CPU its projections are
    packed unless --no-cpu-weight-packing."""
    engine, parallel = engine_configs(args)
    return engine.with_packing_default(owns_model=True), parallel


def _app(args: argparse.Namespace, engine: ServedEngine, ep_totals: EPTotals | None = None) -> FastAPI:
    """The server over `engine`; `ep_totals`: rank 0's expert-parallel stats, for /metrics (`--ep N`, `--dp D`)."""
    from openk3.api.chat import generation_stop_ids, load_chat_template
    from openk3.api.server import ServerConfig, create_app
    from openk3.serve.loading import ASSETS

    model_dir = Path(args.model) if Path(args.model).is_dir() else ASSETS / str(args.model)
    folder = model_dir if model_dir.is_dir() else None
    template = load_chat_template(folder, args.chat_template)
    frontend, limits = server_settings(args)
    config = ServerConfig(
        connection=connection_settings(args),
        model_name=args.served_model_name or str(args.model),
        model_root=str(args.model),
        api_key=args.api_key,
        max_body_bytes=int(args.max_body_mb * 2**20),
        shutdown_timeout_s=args.shutdown_timeout,
        stop_token_ids=generation_stop_ids(folder),
        frontend=frontend,
        limits=limits,
        heap_trim_slack_bytes=int(args.heap_trim_slack_mb * 2**20) if args.heap_trim_slack_mb >= 0 else None,
    )
    app = create_app(engine, engine.tokenizer, template, config)
    if ep_totals is not None:
        app.state.metrics.attach_ep(ep_totals)
    return app


def _uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    options = dict(host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_timeout)
    return options | connection_settings(args).uvicorn_options()


def serve_until_stopped(app: FastAPI, args: argparse.Namespace) -> int:
    """Serve until a signal stops the server (0) or the engine loop fails (1): a dead engine cannot recover, so the process
    ends non-zero and its supervisor (torchrun, Kubernetes, Ray) restarts it, instead of answering 503 for good."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, **_uvicorn_options(args)))
    frontend = app.state.served.frontend

    def stop(error: BaseException) -> None:  # on the engine thread; uvicorn's main loop polls the flag
        logging.getLogger("openk3.api").error("the engine loop failed (%r): stopping the server", error)
        server.should_exit = True

    frontend.on_failure = stop
    server.run()
    return 1 if frontend.error is not None else 0


def _scale_cli() -> Any:
    # by name, as openk3/cli.py finds sub-commands: openk3.scale builds on this module, so a static import would be a cycle
    return importlib.import_module("openk3.scale.cli")


def run(args: argparse.Namespace) -> int:
    if args.replicas is not None:
        return int(_scale_cli().run(args))
    refused = _scale_cli().refuse_without_replicas(args)
    if refused is not None:
        print(f"openk3 serve: {refused}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config, parallel = server_configs(args)  # refused on every rank alike, before any rank joins a group
        config.check_ops_on_device()  # and before the weights load
    except ValueError as e:
        print(f"openk3 serve: {e}", file=sys.stderr)
        return 2
    from openk3.serve.cpu_heap import apply_heap_mode

    apply_heap_mode(args.cpu_heap)  # the process's own setting, on every rank (serve/cpu_heap.py)
    if parallel.dp > 1:
        return run_data_parallel(args)
    if parallel.world_size > 1:
        return run_expert_parallel(args)
    try:
        app = build_server(args)
    except ValueError as e:
        print(f"openk3 serve: {e}", file=sys.stderr)
        return 2
    return _export_expert_load(app, serve_until_stopped(app, args))


def run_expert_parallel(args: argparse.Namespace) -> int:
    """One rank of `torchrun --nproc-per-node N -m openk3 serve --ep N` (or `--tp N`; openk3.parallel.serving.torchrun):
    rank 0 serves HTTP and drives, the others follow."""
    from openk3.parallel.serving.ranks import run_worker_rank
    from openk3.parallel.serving.torchrun import serve_ranks

    engine, parallel = server_configs(args)
    spec = _engine_spec(args, engine, parallel).rank_spec(collect_stats=True)
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
    spec = _engine_spec(args, engine, parallel).rank_spec(collect_stats=True)
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


class _RankGroup(Protocol):
    """What rank 0 drives the other ranks through: an EPDriver, or a DataParallelEngine."""

    @property
    def failed(self) -> bool: ...

    def close(self) -> None: ...


def _serve_then_release(app: FastAPI, args: argparse.Namespace, group: _RankGroup, kind: str) -> int:
    """Rank 0: serve until stopped, release the other ranks, write the expert load if asked; 1 when a step failed."""
    log = logging.getLogger("openk3.parallel.serving")
    _keep_handlers_until_workers_stop(log)
    try:
        rc = serve_until_stopped(app, args)
    finally:
        # after a failed step this sends nothing (the workers are stuck in that step); destroying the group afterwards
        # closes the sockets they wait on, so they fail and exit instead of waiting out its timeout
        group.close()
    rc = _export_expert_load(app, rc)
    if group.failed:
        log.error("rank 0: %s step failed; tearing the group down", kind)
        return 1
    return rc
