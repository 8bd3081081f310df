"""`openk3 serve`: its flags (the engine's, the HTTP server's, the process's, and scale-out's), and which processes
serve: one, torchrun's ranks (launch/topology.py), or Ray Serve replicas (launch/replicas.py)."""

from __future__ import annotations

import argparse
import logging
import sys

from openk3.api.metrics import check_prefix
from openk3.launch.serve_flags import add_serve_arguments
from openk3.launch.server import build_server, claim_port, export_expert_load, serve_until_stopped, server_configs
from openk3.scale import cli as scale_cli


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_serve_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.replicas is not None:
        from openk3.launch.replicas import run_replicas

        return run_replicas(args)
    refused = scale_cli.refuse_without_replicas(args)
    if refused is not None:
        print(f"openk3 serve: {refused}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config, parallel = server_configs(args)  # refused on every rank alike, before any rank joins a group
        config.check_ops_on_device()  # and before the weights load
        check_prefix(args.metrics_prefix)
    except ValueError as e:
        print(f"openk3 serve: {e}", file=sys.stderr)
        return 2
    from openk3.serve.cpu_heap import apply_heap_mode

    apply_heap_mode(args.cpu_heap)  # the process's own setting, on every rank (serve/cpu_heap.py)
    if parallel.dp > 1:
        from openk3.launch.topology import run_data_parallel

        return run_data_parallel(args)
    if parallel.world_size > 1:
        from openk3.launch.topology import run_expert_parallel

        return run_expert_parallel(args)
    try:
        sock = claim_port(args)  # before the weights load, so a port in use is found at once
    except OSError as e:
        print(f"openk3 serve: {e}", file=sys.stderr)
        return 2
    try:
        app = build_server(args)
    except ValueError as e:
        sock.close()
        print(f"openk3 serve: {e}", file=sys.stderr)
        return 2
    return export_expert_load(app, serve_until_stopped(app, args, sock))
