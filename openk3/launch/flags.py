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
