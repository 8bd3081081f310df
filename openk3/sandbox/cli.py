"""`openk3 sandbox serve`: run this host's sandbox daemon (HTTP) until interrupted, then destroy everything it created."""

from __future__ import annotations

import argparse
import signal

from openk3.sandbox.namespace.settings import BackendConfig
from openk3.sandbox.process.registry import EnvFactories
from openk3.sandbox.protocol import SandboxError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("sandbox", help="AgentEnv-style RL sandboxes (namespaces + overlay + cgroups)")
    sub = parser.add_subparsers(dest="sandbox_command", required=True)
    serve = sub.add_parser("serve", help="serve the sandbox API over HTTP on this host (needs root)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; the API is unauthenticated)")
    serve.add_argument("--port", type=int, default=8700)
    serve.add_argument("--state-dir", default="/run/openk3-sandbox", help="tmpfs mount point for layers and sandbox roots")
    serve.add_argument("--store-bytes", type=int, default=8 * 2**30, help="size of the layer/state tmpfs")
    serve.add_argument("--workers", type=int, default=8, help="threads running blocking sandbox operations")
    serve.add_argument(
        "--sandbox-uid",
        type=int,
        default=BackendConfig.sandbox_uid,
        help="host uid and gid of every sandbox's root (default 100000); no user, group or /etc/subuid range may use it",
    )
    serve.add_argument(
        "--env-factory",
        action="append",
        default=[],
        metavar="NAME=MODULE:CALLABLE",
        help="allow create_env(factory=NAME) to start MODULE:CALLABLE as a host-side Python environment (repeatable; 'demo' is built in)",
    )
    serve.add_argument("--env-pythonpath", action="append", default=[], metavar="DIR", help="extra import directory for --env-factory modules (repeatable)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from openk3.sandbox.api.server import serve
    from openk3.sandbox.api.service import SandboxService

    if args.workers < 1:
        print(f"--workers={args.workers}: expected >= 1")
        return 2
    try:
        factories = EnvFactories.parse(args.env_factory, args.env_pythonpath)
        service = SandboxService(BackendConfig(state_dir=args.state_dir, store_bytes=args.store_bytes, sandbox_uid=args.sandbox_uid), factories)
    except SandboxError as e:
        print(f"openk3 sandbox serve: {e}")
        return 1
    # uvicorn re-raises SIGTERM after its graceful shutdown; as an exception it unwinds through `finally`, so the sandboxes,
    # mounts and cgroups go away with the daemon instead of waiting for the next start's crash recovery.
    signal.signal(signal.SIGTERM, _exit_on_term)
    try:
        serve(service, args.host, args.port, args.workers)
    except SystemExit:
        pass
    finally:
        service.close()
    return 0


def _exit_on_term(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)
