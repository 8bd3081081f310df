"""`openk3 serve --replicas N` from the launch side: the flags read once into a ReplicaLaunch (paths made absolute,
since a replica runs in a Ray worker process whose working directory is not the caller's), and what each replica runs:
the same build_server as one `openk3 serve`, its other ranks (--tp/--ep/--dp) spawned on its own node as `LLM(ep=N)`
spawns them. openk3.scale places, routes and runs the replicas (docs/scale-out.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from openk3.launch.serve_flags import parse_serve_arguments
from openk3.launch.server import build_server, build_server_with_local_ranks, server_configs
from openk3.scale.replica_launch import ReplicaLaunch, SpawnedRanks

if TYPE_CHECKING:
    from fastapi import FastAPI
    from ray.serve import Application

    from openk3.scale.deploy import ScaleConfig

# the flags that name files or folders: a relative path would name another place in a replica's process (or nothing)
PATH_FLAGS = ("model", "chat_template", "eplb_stats", "disk_offload_dir")


def with_absolute_paths(serve_args: argparse.Namespace) -> argparse.Namespace:
    """`serve_args` with every relative path flag made absolute against this process's working directory (a `--model`
    that is a preset name, not an existing path, stays as it is)."""
    out = argparse.Namespace(**vars(serve_args))
    for name in PATH_FLAGS:
        value = getattr(out, name, None)
        if value is None:
            continue
        path = Path(value)
        if not path.is_absolute() and (name != "model" or path.exists()):
            setattr(out, name, str(path.resolve()) if isinstance(value, str) else path.resolve())
    return out


def replica_launch(serve_args: argparse.Namespace | list[str]) -> ReplicaLaunch:
    """The replicas' flags (parsed `openk3 serve` flags, or their argument list) as the scale-out takes them."""
    args = with_absolute_paths(parse_serve_arguments(serve_args) if isinstance(serve_args, list) else serve_args)
    engine, parallel = server_configs(args)
    return ReplicaLaunch(args, engine, parallel, build_replica_server)


def build_replica_server(serve_args: argparse.Namespace) -> tuple[FastAPI, SpawnedRanks | None]:
    """In a replica's process: its app, and the ranks it spawned (None with one rank)."""
    if server_configs(serve_args)[1].world_size > 1:
        return build_server_with_local_ranks(serve_args)
    return build_server(serve_args), None


def replica_application(serve_args: argparse.Namespace | list[str], config: ScaleConfig) -> Application:
    """The Ray Serve Application of `config`'s replicas for these `openk3 serve` flags (for `serve.run`)."""
    from openk3.scale.deploy import application

    return application(replica_launch(serve_args), config)


def run_replicas(args: argparse.Namespace) -> int:
    from openk3.scale import cli as scale_cli

    try:
        launch = replica_launch(args)
    except ValueError as e:
        print(f"openk3 serve: {e}", file=sys.stderr)
        return 2
    return scale_cli.run(args, launch)
