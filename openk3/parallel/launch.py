"""Starting ranks: under `torchrun` (env vars) or on N local processes via torch.multiprocessing.spawn (tests, benchmarks).

gloo on CPU, NCCL on CUDA. `run_ranks(fn, n, *args)` runs `fn(ctx, *args)` on n fresh processes and returns their results
in rank order; `fn` must be a module-level function and its results plain Python objects (tensors sent through the result
queue would outlive the shared memory of the process that made them).
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from openk3.parallel.group import ParallelContext


def free_port() -> int:
    """A TCP port the OS reports free now (bound and released; the process group binds it again right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: str | torch.device, local_rank: int) -> torch.device:
    """The device one rank runs on: a bare "cuda" means this rank's own GPU (local rank r takes GPU r); anything else as given."""
    dev = torch.device(device)
    return torch.device("cuda", local_rank) if dev.type == "cuda" and dev.index is None else dev


def join_group(rank: int, world_size: int, init_method: str, device: torch.device, timeout: datetime.timedelta | None = None) -> ParallelContext:
    """The one rank start-up every entry uses (run_ranks, LocalEP's ranks, torchrun): pin the GPU, join the default group
    (gloo on CPU, NCCL on CUDA), and return this rank's context in it."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    return ParallelContext.from_group(device)


def init_from_env(device: str | None = None, timeout: datetime.timedelta | None = None) -> ParallelContext:
    """Join the group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT); one GPU per local rank.
    `timeout`: how long start-up and each collective wait for the other ranks (torch's default when None)."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_from_env: environment lacks {', '.join(missing)}; start with torchrun or use run_ranks")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = rank_device(device or ("cuda" if torch.cuda.is_available() else "cpu"), local_rank)
    return join_group(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", dev, timeout)


def _rank_main(rank: int, fn: Callable[..., Any], world_size: int, port: int, device: str, threads: int, results: Any, args: tuple) -> None:
    torch.set_num_threads(threads)
    ctx = join_group(rank, world_size, f"tcp://127.0.0.1:{port}", rank_device(device, rank))
    try:
        result = fn(ctx, *args)
        dist.barrier()  # nobody tears the group down while another rank is still inside a collective (gloo aborts then)
        results.put((rank, result))
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, device: str = "cpu", threads: int = 1) -> list[Any]:
    """Run fn(ctx, *args) on `world_size` spawned local ranks; an exception on any rank is raised here."""
    if world_size < 1:
        raise ValueError(f"run_ranks: world_size={world_size}, expected >= 1")
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"run_ranks: world_size={world_size} CUDA ranks, only {torch.cuda.device_count()} GPUs visible")
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank_main, args=(fn, world_size, free_port(), device, threads, results, args), nprocs=world_size, join=True)
    out = dict(results.get() for _ in range(world_size))
    return [out[r] for r in range(world_size)]
