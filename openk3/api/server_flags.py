"""`openk3 serve`'s HTTP server flags: admission (the front end's queue, what one request may ask for), what one
connection may cost, when an idle server trims its C heap, and which RL weight routes it allows. The engine's own flags are the launch layer's
(launch/flags.py)."""

from __future__ import annotations

import argparse
from typing import Any

from openk3.options import add_arguments, from_args


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """`openk3 serve`'s admission settings: the front end's queue (FrontendConfig) and what one request may ask for
    (RequestLimits); and when an idle server trims its C heap (serve/heap_trim.py)."""
    from openk3.api.connection import ConnectionConfig
    from openk3.api.limits import RequestLimits
    from openk3.api.routes.state import WeightUpdateConfig
    from openk3.serve.config import FrontendConfig

    add_arguments(p, FrontendConfig)
    add_arguments(p, WeightUpdateConfig)  # the RL weight routes the operator allows (routes/weights.py)
    add_arguments(p, RequestLimits)
    add_arguments(p, ConnectionConfig)  # what one connection may cost: uvicorn's bounds, the body deadline, CORS
    p.add_argument(
        "--heap-trim-slack-mb",
        type=float,
        default=256.0,
        help="when the server goes idle with its RSS more than this many MiB above its start-up RSS, give the C heap's free "
        "memory back to the kernel (malloc_trim); negative: never (default 256)",
    )
    p.add_argument(
        "--responses-store-size",
        type=int,
        default=1024,
        help="how many /v1/responses responses are kept in memory (previous_response_id, GET and DELETE /v1/responses/{id}), "
        "least recently used evicted first (default 1024)",
    )
    p.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        metavar="HOST",
        help="host names image URLs may be fetched from (exact names, as vLLM's flag; api/media_fetch.py); default: none, only data: URLs are accepted",
    )
    p.add_argument("--media-fetch-timeout-s", type=float, default=10.0, help="deadline for fetching one image URL, redirects included (default 10)")
    p.add_argument(
        "--metrics-prefix",
        default="openk3:",
        help="prefix of the engine's metric names on /metrics (default openk3:); vllm: gives vLLM's own names, so stock vLLM "
        "dashboards and alerts work unchanged",
    )


def server_settings(args: argparse.Namespace) -> tuple[Any, Any]:
    """(FrontendConfig, RequestLimits) from flags added by add_server_arguments."""
    from openk3.api.limits import RequestLimits
    from openk3.serve.config import FrontendConfig

    return from_args(FrontendConfig, args), from_args(RequestLimits, args)


def weight_update_settings(args: argparse.Namespace) -> Any:
    """The WeightUpdateConfig from flags added by add_server_arguments."""
    from openk3.api.routes.state import WeightUpdateConfig

    return from_args(WeightUpdateConfig, args)


def connection_settings(args: argparse.Namespace) -> Any:
    """The ConnectionConfig from flags added by add_server_arguments."""
    from openk3.api.connection import ConnectionConfig

    return from_args(ConnectionConfig, args)


def media_fetch_settings(args: argparse.Namespace) -> Any:
    """The MediaFetchConfig from --allowed-media-domains and --media-fetch-timeout-s."""
    from openk3.api.media_fetch import MediaFetchConfig

    return MediaFetchConfig(tuple(args.allowed_media_domains or ()), args.media_fetch_timeout_s)
