"""Flags shared by `openk3 serve` and `openk3 generate`: every EngineConfig and ParallelConfig setting (built from their
declarations, openk3/options.py), and the process-wide settings of a serving process."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from openk3.options import add_arguments, from_args


def add_engine_arguments(p: argparse.ArgumentParser, exclude: Sequence[str] = ()) -> None:
    from openk3.parallel.config import ParallelConfig
    from openk3.serve.config import EngineConfig

    add_arguments(p, EngineConfig, exclude)
    add_arguments(p, ParallelConfig, exclude)


def engine_configs(args: argparse.Namespace, exclude: Sequence[str] = (), **fixed: Any) -> tuple[Any, Any]:
    """(EngineConfig, ParallelConfig) from parsed flags (`exclude`: as given to add_engine_arguments); `fixed` sets
    EngineConfig fields the command decides itself."""
    from openk3.parallel.config import ParallelConfig
    from openk3.serve.config import EngineConfig

    engine = from_args(EngineConfig, args, exclude, **fixed)
    parallel = from_args(ParallelConfig, args, exclude)
    parallel.check_engine(engine)
    return engine, parallel


def add_process_arguments(p: argparse.ArgumentParser) -> None:
    """Process-wide settings of a serving process (not of an engine): the C heap (serve/cpu_heap.py)."""
    from openk3.serve.cpu_heap import HEAP_MODES, default_heap_mode

    p.add_argument(
        "--cpu-heap",
        choices=HEAP_MODES,
        default=default_heap_mode(),
        help="keep: freed heap memory stays in the process for the next step's temporaries (faster CPU steps, RSS stays at its "
        "high-water mark); system: the C library's defaults (default: $OPENK3_CPU_HEAP, else keep)",
    )


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """`openk3 serve`'s admission settings: the front end's queue (FrontendConfig) and what one request may ask for
    (RequestLimits); and when an idle server trims its C heap (serve/heap_trim.py)."""
    from openk3.api.connection import ConnectionConfig
    from openk3.api.limits import RequestLimits
    from openk3.serve.config import FrontendConfig

    add_arguments(p, FrontendConfig)
    add_arguments(p, RequestLimits)
    add_arguments(p, ConnectionConfig)  # what one connection may cost: uvicorn's bounds, the body deadline, CORS
    p.add_argument(
        "--heap-trim-slack-mb",
        type=float,
        default=256.0,
        help="when the server goes idle with its RSS more than this many MiB above its start-up RSS, give the C heap's free "
        "memory back to the kernel (malloc_trim); negative: never (default 256)",
    )


def server_settings(args: argparse.Namespace) -> tuple[Any, Any]:
    """(FrontendConfig, RequestLimits) from flags added by add_server_arguments."""
    from openk3.api.limits import RequestLimits
    from openk3.serve.config import FrontendConfig

    return from_args(FrontendConfig, args), from_args(RequestLimits, args)


def connection_settings(args: argparse.Namespace) -> Any:
    """The ConnectionConfig from flags added by add_server_arguments."""
    from openk3.api.connection import ConnectionConfig

    return from_args(ConnectionConfig, args)
