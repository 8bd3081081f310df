"""ReplicaLaunch: what the scale-out needs of the `openk3 serve` flags, handed down by the launch layer, which owns
reading them and building engines and servers (openk3/launch/replicas.py). Ray pickles it into every replica's
process, so `build_server` must be a module-level function (pickled by name)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from fastapi import FastAPI

    from openk3.parallel.config import ParallelConfig
    from openk3.serve.config import EngineConfig


class SpawnedRanks(Protocol):
    """The other ranks a multi-rank replica spawned on its node (a LocalEP): close() stops them."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class ReplicaLaunch:
    serve_args: argparse.Namespace  # the replicas' `openk3 serve` flags (paths absolute); the front end reads the model's from them
    engine: EngineConfig  # read from those flags: what the whole application is checked and placed by
    parallel: ParallelConfig
    # run in each replica's process: its server app, and its spawned ranks (None for a one-rank replica)
    build_server: Callable[[argparse.Namespace], tuple[FastAPI, SpawnedRanks | None]]
