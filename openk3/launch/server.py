"""The `openk3 serve` app: the engine `serve` flags describe (built by build_engine), under api/'s HTTP server (its
ServerConfig read from the same flags), and the loop that serves it until a signal or a dead engine stops it. Used by
every way of running the server: one process, torchrun's rank 0 (launch/topology.py), and each Ray replica
(launch/replicas.py)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from openk3.api.server_flags import connection_settings, media_fetch_settings, server_settings, weight_update_settings
from openk3.launch.flags import engine_configs

if TYPE_CHECKING:  # torch and the server load lazily, so `openk3 plan` and `--help` stay fast
    from fastapi import FastAPI

    from openk3.launch.spec import EngineSpec
    from openk3.parallel.config import ParallelConfig
    from openk3.parallel.group import ParallelContext
    from openk3.parallel.serving.driver import EPTotals
    from openk3.serve.config import EngineConfig
    from openk3.serve.engine_api import ServedEngine


def build_server(args: argparse.Namespace, group: ParallelContext | None = None) -> FastAPI:
    """The FastAPI app for parsed `serve` arguments (also used by tests and benchmarks).

    With `group` (rank 0 of a joined multi-rank group under torchrun) the engine's model is an EPDriver whose steps are
    broadcast to the worker ranks in run_worker_rank, or with --dp the engine is a DataParallelEngine over every rank's;
    `app.state.rank_group.close()` releases the other ranks."""
    import torch

    from openk3.launch.engine import build_engine

    config, parallel = server_configs(args)
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    built = build_engine(engine_spec(args, config, parallel), group)
    try:
        app = _app(args, built.core, built.ep_totals)
        _record_expert_load(app, built.counted_model, parallel)
        _log_startup(app, args, built.core, parallel)
    except BaseException:
        if built.group is not None:
            built.group.close()
        raise
    if built.group is not None:
        app.state.rank_group = built.group
    return app


def engine_spec(args: argparse.Namespace, config: EngineConfig, parallel: ParallelConfig) -> EngineSpec:
    from openk3.launch.spec import EngineSpec

    return EngineSpec(args.model, config, parallel, byte_tokenizer=args.tokenizer == "byte")


def _record_expert_load(app: FastAPI, model: Any, parallel: ParallelConfig) -> None:
    """--export-eplb-stats: count rank 0's routing (it sees every token) from now on; export_expert_load writes it."""
    app.state.expert_load = None
    if parallel.export_eplb_stats is not None:
        from openk3.parallel.ep.load_stats import record_expert_load

        app.state.expert_load = record_expert_load(model, parallel.export_eplb_stats)  # after build_engine prepared the model


def export_expert_load(app: FastAPI, rc: int) -> int:
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
    built = build_engine(engine_spec(args, config, parallel))
    assert built.local_ranks is not None
    try:
        app = _app(args, built.core)
        _log_startup(app, args, built.core, parallel)
    except BaseException:
        built.local_ranks.close()
        raise
    return app, built.local_ranks


def _log_startup(app: FastAPI, args: argparse.Namespace, engine: ServedEngine, parallel: ParallelConfig) -> None:
    from openk3.launch.startup_log import log_startup

    log_startup(engine, app.state.served.model.name, str(args.model), parallel, args.host, args.port)


def server_configs(args: argparse.Namespace) -> tuple[EngineConfig, ParallelConfig]:
    """The engine and parallel settings of parsed `serve` flags. The server owns its model, so on CPU its projections are
    packed unless --no-cpu-weight-packing."""
    engine, parallel = engine_configs(args, **speculative_settings(args))
    return engine.with_packing_default(owns_model=True), parallel


SPECULATIVE_KEYS = {
    "method": "speculative_method",
    "model": "speculative_model",
    "num_speculative_tokens": "num_speculative_tokens",
    "disable_by_batch_size": "speculative_disable_by_batch_size",
}
SPECULATIVE_METHODS = ("draft_model", "mtp", "eagle3")


def speculative_settings(args: argparse.Namespace) -> dict[str, Any]:
    """--speculative-config (vLLM's JSON) as the EngineConfig fields it stands for: method "draft_model" (a separate
    draft model, `model`), "mtp" (the checkpoint's own multi-token-prediction layer; no `model`) or "eagle3" (an EAGLE-3
    head folder, `model`). Another method, an
    unknown key, or a key also given by its own flag is an error naming it, not a setting quietly dropped."""
    config = getattr(args, "speculative_config", None)
    if config is None:
        return {}
    method = config.get("method", "draft_model")
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"--speculative-config method={method!r} is not supported: openk3 has {', '.join(map(repr, SPECULATIVE_METHODS))}")
    unknown = sorted(set(config) - set(SPECULATIVE_KEYS))
    if unknown:
        raise ValueError(f"--speculative-config key {unknown[0]!r} is not read; it reads: {', '.join(SPECULATIVE_KEYS)}")
    if method == "draft_model" and "model" not in config:
        raise ValueError("--speculative-config needs 'model': the draft model (a preset or checkpoint folder)")
    if method == "eagle3" and "model" not in config:
        raise ValueError("--speculative-config method 'eagle3' needs 'model': the EAGLE-3 head's folder")
    if method == "mtp" and "model" in config:
        raise ValueError("--speculative-config method 'mtp' reads the served checkpoint's own MTP layer: leave out 'model'")
    out = {}
    for key, field_name in SPECULATIVE_KEYS.items():
        if key in config or key == "method":
            if getattr(args, field_name, None) != _flag_default(field_name):
                raise ValueError(f"--speculative-config {key} and --{field_name.replace('_', '-')} both given: give one")
            out[field_name] = config.get(key, method)
    return out


def _flag_default(field_name: str) -> Any:
    from openk3.serve.config import EngineConfig

    return next(f.default for f in dataclasses.fields(EngineConfig) if f.name == field_name)


def _app(args: argparse.Namespace, engine: ServedEngine, ep_totals: EPTotals | None = None) -> FastAPI:
    """The server over `engine`; `ep_totals`: rank 0's expert-parallel stats, for /metrics (`--ep N`, `--dp D`)."""
    from openk3.api.chat_loading import load_chat_template
    from openk3.api.served_model import ModelIdentity
    from openk3.api.server import ServerConfig, create_app
    from openk3.serve.generation_config import read_generation_config
    from openk3.serve.loading import ASSETS
    from openk3.serve.vision_processor import read_media_config

    model_dir = Path(args.model) if Path(args.model).is_dir() else ASSETS / str(args.model)
    folder = model_dir if model_dir.is_dir() else None
    template = load_chat_template(folder, args.chat_template)
    generation = read_generation_config(folder)
    frontend, limits = server_settings(args)
    config = ServerConfig(
        connection=connection_settings(args),
        model=ModelIdentity(args.served_model_name or str(args.model), str(args.model), generation.eos_token_ids, generation.defaults),
        api_key=args.api_key,
        max_body_bytes=int(args.max_body_mb * 2**20),
        shutdown_timeout_s=args.shutdown_timeout,
        frontend=frontend,
        limits=limits,
        heap_trim_slack_bytes=int(args.heap_trim_slack_mb * 2**20) if args.heap_trim_slack_mb >= 0 else None,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        response_store_size=args.responses_store_size,
        metrics_prefix=args.metrics_prefix,
        media=read_media_config(folder),
        media_fetch=media_fetch_settings(args),
        weight_updates=weight_update_settings(args),
    )
    app = create_app(engine, engine.tokenizer, template, config)
    if ep_totals is not None:
        app.state.metrics.attach_ep(ep_totals)
    return app


def _uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    options = dict(host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_timeout)
    return options | connection_settings(args).uvicorn_options()


def claim_port(args: argparse.Namespace) -> socket.socket:
    """The listening socket for --host/--port, bound before the model loads: a port in use is an error at once, not after
    the weights have loaded. OSError (EADDRINUSE, ...) names the address."""
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a port in TIME_WAIT is free
        sock.bind((args.host, args.port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {args.host}:{args.port}: {e.strerror}") from e
    return sock


def serve_until_stopped(app: FastAPI, args: argparse.Namespace, sock: socket.socket | None = None) -> int:
    """Serve until a signal stops the server (0) or the engine loop fails (1): a dead engine cannot recover, so the process
    ends non-zero and its supervisor (torchrun, Kubernetes, Ray) restarts it, instead of answering 503 for good. `sock`:
    the socket claim_port bound (else uvicorn binds --host/--port itself)."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, **_uvicorn_options(args)))
    frontend = app.state.served.frontend

    def stop(error: BaseException) -> None:  # on the engine thread; uvicorn's main loop polls the flag
        logging.getLogger("openk3.api").error("the engine loop failed (%r): stopping the server", error)
        server.should_exit = True

    frontend.on_failure = stop
    if sock is None:
        server.run()
    else:
        server.run(sockets=[sock])
    return 1 if frontend.error is not None else 0
