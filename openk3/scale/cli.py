"""`openk3 serve --replicas N`: the replicas on Ray Serve behind one endpoint on --host/--port (launch/cli.py dispatches
here, with the flags read into a ReplicaLaunch by launch/replicas.py).

The other `openk3 serve` flags configure every replica's engine and server, as for one `openk3 serve`. A local Ray cluster
is started unless --ray-address names one, in a process group of its own (cluster.py LocalCluster): SIGTERM or SIGINT to
the server, or to its whole process group, drains the replicas, stops that cluster and exits 0. Imports of Ray wait until
the command runs, so `openk3 --help` stays fast.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from openk3.scale.replica_launch import ReplicaLaunch


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scale-out on Ray Serve (docs/scale-out.md)")
    g.add_argument("--replicas", type=int, default=None, help="serve N engine replicas on Ray Serve behind one endpoint")
    g.add_argument(
        "--replica-router",
        choices=("prefix", "pow2"),
        default=None,
        help="with --replicas: prefix (longest cached prefix, then least loaded; the default) or pow2 (Ray's default)",
    )
    g.add_argument(
        "--prefill-replicas",
        type=int,
        default=None,
        help="with --replicas: add P prefill replicas; the --replicas N then decode, each prompt handed over with its KDA state and MLA latents",
    )
    g.add_argument(
        "--replica-prefix-pull",
        choices=("on", "off"),
        default=None,
        help="with --replicas and the prefix router: a replica lacking a prefix another replica holds pulls its cached state "
        "instead of computing it (default: on for one-rank replicas without a prefill pool)",
    )
    g.add_argument("--replica-cpus", type=float, default=None, help="with --replicas: Ray CPUs per rank of a replica (default 1)")
    g.add_argument("--ray-address", default=None, help="with --replicas: the Ray cluster to join (default: start a local one)")


def refuse_without_replicas(args: argparse.Namespace) -> str | None:
    """The scale-out flag given without --replicas, if any (an error: it would be ignored)."""
    for name in ("replica_router", "prefill_replicas", "replica_prefix_pull", "replica_cpus", "ray_address"):
        if getattr(args, name) is not None:
            return f"--{name.replace('_', '-')} needs --replicas N"
    return None


def run(args: argparse.Namespace, launch: ReplicaLaunch) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from openk3.scale.deploy import ScaleConfig, application

    try:
        config = ScaleConfig(
            replicas=args.replicas,
            prefill_replicas=args.prefill_replicas or 0,
            router=args.replica_router or "prefix",
            replica_cpus=1.0 if args.replica_cpus is None else args.replica_cpus,
            prefix_pull=None if args.replica_prefix_pull is None else args.replica_prefix_pull == "on",
        )
        app = application(launch, config)
    except ValueError as e:
        print(f"openk3 serve: {e}", file=sys.stderr)
        return 2
    import ray
    from ray import serve

    from openk3.scale.cluster import LocalCluster, RayStartError, connect

    cluster = None
    try:
        if args.ray_address is None:
            cluster = LocalCluster.start()  # in its own process group: a signal to ours reaches only this process
        connect(args.ray_address if cluster is None else cluster.address)
    except RayStartError as e:
        print(f"openk3 serve: {e}", file=sys.stderr)
        if cluster is not None:
            cluster.close()
        return 1
    # after ray.init, which installs a handler of its own that ends the process on SIGTERM; from here a signal, also one
    # that comes while the replicas start, lets serve.run finish and then stops everything in order
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda _num, _frame: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name=config.app_name, route_prefix="/")
        pools = f"{config.prefill_replicas} prefill + {config.replicas} decode replicas" if config.prefill_replicas else f"{config.replicas} replicas"
        print(f"openk3 serve: {pools} ({config.router} routing) on http://{args.host}:{args.port}", file=sys.stderr)
        stop.wait()
        print("openk3 serve: stopping: draining the replicas", file=sys.stderr)
        serve.delete(config.app_name)
        serve.shutdown()
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.close()
    return 0
