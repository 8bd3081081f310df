"""`openk3 sandbox serve`: run this host's sandbox daemon (HTTP) until interrupted, then destroy everything it created."""

from __future__ import annotations

import argparse
import os
import signal

from openk3.sandbox.api.output_budget import DEFAULT_OUTPUT_BUDGET
from openk3.sandbox.namespace.settings import BackendConfig
from openk3.sandbox.process.registry import EnvFactories
from openk3.sandbox.protocol import SandboxError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("sandbox", help="AgentEnv-style RL sandboxes (namespaces + overlay + cgroups)")
    sub = parser.add_subparsers(dest="sandbox_command", required=True)
    serve = sub.add_parser("serve", help="serve the sandbox API over HTTP on this host (needs root)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; any other address needs an API key)")
    serve.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on every request (default: the OPENK3_SANDBOX_API_KEY variable; a key given "
        "here is visible in the host's process list, so prefer the variable or --api-key-file)",
    )
    serve.add_argument("--api-key-file", default=None, metavar="PATH", help="read the API key from this file (its first line)")
    serve.add_argument(
        "--keys-file",
        default=None,
        metavar="PATH",
        help="JSON file of tenants, each with its own API key and quotas (docs/sandbox.md, Tenants); mode 600; replaces --api-key",
    )
    serve.add_argument("--no-api-key", action="store_true", help="allow a non-loopback --host without a key (behind an authenticating proxy)")
    serve.add_argument("--port", type=int, default=8700)
    serve.add_argument("--state-dir", default="/run/openk3-sandbox", help="tmpfs mount point for layers and sandbox roots")
    serve.add_argument("--store-bytes", type=int, default=8 * 2**30, help="size of the layer/state tmpfs")
    serve.add_argument(
        "--keep-snapshots",
        action="store_true",
        help="on SIGTERM keep the state tmpfs with its fs snapshots for the next start on this --state-dir (a kill -9 always keeps them)",
    )
    serve.add_argument("--workers", type=int, default=8, help="threads running blocking sandbox operations")
    serve.add_argument(
        "--output-budget-bytes",
        type=int,
        default=DEFAULT_OUTPUT_BUDGET,
        help="bytes of background-process output the daemon keeps for callers, all processes together (default 256 MiB); "
        "beyond it the largest streams drop their oldest bytes",
    )
    serve.add_argument(
        "--sandbox-uid",
        type=int,
        default=BackendConfig.sandbox_uid,
        help="host uid and gid that owns the base and the layers on disk (default 100000); each sandbox runs as its own id above it (see --sandbox-uids)",
    )
    serve.add_argument(
        "--sandbox-uids",
        type=int,
        default=BackendConfig.sandbox_uids,
        help="ids reserved from --sandbox-uid on (default 65536: 100000..165535); one per live sandbox, so at most this many "
        "minus one at once; no user, group or /etc/subuid or /etc/subgid range may use any of them",
    )
    serve.add_argument(
        "--sandbox-ptys",
        type=int,
        default=BackendConfig.sandbox_ptys,
        help="ptys one sandbox may have open at once (default 64); all sandboxes share the host's kernel.pty.max",
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
    from openk3.sandbox.api import auth, tenants
    from openk3.sandbox.api.server import serve
    from openk3.sandbox.api.service import SandboxService

    if args.workers < 1:
        print(f"--workers={args.workers}: expected >= 1")
        return 2
    api_key = args.api_key or os.environ.get(auth.ENV_VAR) or None
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file) as f:
                api_key = f.readline().strip() or None
        except OSError as e:
            print(f"openk3 sandbox serve: --api-key-file={args.api_key_file!r}: {e.strerror}")
            return 2
    keys = None
    if args.keys_file is not None:
        if api_key is not None:
            print(f"openk3 sandbox serve: --keys-file and an API key ({auth.ENV_VAR}, --api-key or --api-key-file): give one")
            return 2
        try:
            keys = tenants.load(args.keys_file)
        except OSError as e:
            print(f"openk3 sandbox serve: --keys-file={args.keys_file!r}: {e.strerror}")
            return 2
        except SandboxError as e:
            print(f"openk3 sandbox serve: {e}")
            return 2
    refusal = None if keys is not None else auth.check_serving(args.host, api_key, args.no_api_key)
    if refusal is not None:
        print(f"openk3 sandbox serve: refusing to start: {refusal}")
        return 2
    try:
        factories = EnvFactories.parse(args.env_factory, args.env_pythonpath)
        config = BackendConfig(
            state_dir=args.state_dir,
            store_bytes=args.store_bytes,
            sandbox_uid=args.sandbox_uid,
            sandbox_uids=args.sandbox_uids,
            sandbox_ptys=args.sandbox_ptys,
        )
        service = SandboxService(config, factories, args.output_budget_bytes)
    except SandboxError as e:
        print(f"openk3 sandbox serve: {e}")
        return 1
    # uvicorn re-raises SIGTERM after its graceful shutdown; as an exception it unwinds through `finally`, so the sandboxes,
    # mounts and cgroups go away with the daemon instead of waiting for the next start's crash recovery.
    signal.signal(signal.SIGTERM, _exit_on_term)
    try:
        serve(service, args.host, args.port, args.workers, api_key, keys)
    except SystemExit:
        pass
    finally:
        service.close(keep_snapshots=args.keep_snapshots)
    return 0


def _exit_on_term(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)
