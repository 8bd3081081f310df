"""Expert-parallel engines: rank 0 drives, the other ranks follow (openk3.dist.driver), for `LLM(..., ep=N)` and
`openk3 serve --ep N`.

Start-up order, the same on every rank because group creation is collective: join the process group, open the step
channel (its own gloo group), build this rank's model (trunk + its experts only, openk3.dist.rank_model), report the
outcome in a handshake (so a rank that failed is reported by rank 0 and the others leave), then rank 0 wraps its model in
an EPDriver for its engine while the others run the worker loop until rank 0 closes the driver.

`LocalEP` is the offline form: the caller's process is rank 0 and N - 1 workers are spawned (torch.multiprocessing,
gloo on CPU, or one GPU per rank). The caller's process joins a default process group for the LLM's lifetime, so it must
not be in one already (under torchrun, use `openk3 serve --ep N` or build the pieces with init_from_env). As with any
spawn, the caller's script needs an `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from openk3.config import preset
from openk3.dist.backend import EPMethod, TokenSplit
from openk3.dist.driver import EPDriver, run_worker
from openk3.dist.group import ParallelContext
from openk3.dist.launch import backend_for, free_port
from openk3.dist.rank_model import attach_rank_experts, engine_placements, load_rank_model
from openk3.dist.step_channel import StepChannel
from openk3.model.model import K3ForCausalLM
from openk3.serve.llm import resolve_model

ModelSource = str | Path | torch.nn.Module
# Start-up and per-collective limit of the group LocalEP creates: a worker that died is reported, not waited for forever.
GROUP_TIMEOUT = datetime.timedelta(minutes=10)
JOIN_TIMEOUT_S = 60.0  # all workers together, after STOP
KILL_GRACE_S = 5.0  # after SIGTERM to workers stuck in a failed step


@dataclass(frozen=True)
class EPConfig:
    size: int
    method: str = EPMethod.MOONEP.value

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"ep={self.size!r} is invalid: expected an integer >= 1 (ranks to spread the experts over)")
        methods = [m.value for m in EPMethod]
        if self.method not in methods:
            raise ValueError(f"ep_method={self.method!r} is invalid: expected one of {methods}")


def build_rank_model(
    source: ModelSource, ctx: ParallelContext, method: str, dtype: torch.dtype, device: torch.device | str, seed: int, collect_stats: bool
) -> tuple[K3ForCausalLM, TokenSplit]:
    """This rank's model with the expert-parallel backend attached. A checkpoint folder is read per rank (own experts
    only); a preset without a checkpoint is built from its seed on every rank, then cut; a module is cut (rank 0 copies its
    shard, so the caller's module keeps its experts)."""
    if isinstance(source, torch.nn.Module):
        if not isinstance(source, K3ForCausalLM):
            raise ValueError(f"ep: the model must be a K3ForCausalLM to shard its experts, got {type(source).__name__}")
        layers = [moe.layer_index for moe in source.moe_layers()]
        placements = engine_placements(layers, source.config.moe.num_experts, ctx.world_size, method)
        backend = attach_rank_experts(source, ctx, method, placements, loaded_per_rank=False, drop_full_banks=ctx.rank != 0, collect_stats=collect_stats)
        return source, backend
    folder = resolve_model(source)
    if folder is not None:
        return load_rank_model(folder, ctx, method, dtype, device, collect_stats)
    config = preset(str(source))
    net = K3ForCausalLM(config)
    net.init_weights(seed)
    net = net.to(device=device, dtype=dtype).eval()
    placements = engine_placements([moe.layer_index for moe in net.moe_layers()], config.moe.num_experts, ctx.world_size, method)
    return net, attach_rank_experts(net, ctx, method, placements, loaded_per_rank=False, drop_full_banks=True, collect_stats=collect_stats)


def _failure(rank: int, error: BaseException) -> str:
    return f"rank {rank}: {type(error).__name__}: {error}"


def run_worker_rank(
    ctx: ParallelContext, source: ModelSource, method: str, dtype: torch.dtype, device: torch.device | str, seed: int, collect_stats: bool
) -> int:
    """A worker rank from joining to STOP: channel, model, start-up handshake, loop; returns the steps it ran (0 when
    some rank failed to start: rank 0 reports that)."""
    channel = StepChannel(ctx)
    try:
        model, backend = build_rank_model(source, ctx, method, dtype, device, seed, collect_stats)
    except Exception as e:
        channel.report_ready(_failure(ctx.rank, e))
        raise
    if any(channel.report_ready(None)):
        return 0
    return run_worker(model, channel, device, backend)


def start_driver(
    ctx: ParallelContext, source: ModelSource, method: str, dtype: torch.dtype, device: torch.device | str, seed: int, collect_stats: bool
) -> tuple[EPDriver, TokenSplit]:
    """Rank 0's side of the start-up: the channel, its model, the handshake, and the driver the engine is given in place
    of the model. Raises this rank's own error, else the first worker's that failed to build its model."""
    channel = StepChannel(ctx)
    try:
        model, backend = build_rank_model(source, ctx, method, dtype, device, seed, collect_stats)
    except Exception as e:
        # the workers wait in the handshake: tell them to leave rather than wait for a first step
        with contextlib.suppress(RuntimeError):
            channel.report_ready(_failure(0, e))
        raise
    failures = [f for f in channel.report_ready(None) if f is not None]
    if failures:
        raise RuntimeError(f"expert-parallel start-up failed on {len(failures)} rank(s): " + "; ".join(failures))
    return EPDriver(model, channel, backend.inner), backend


def _local_worker(rank: int, size: int, port: int, source: ModelSource, method: str, dtype: torch.dtype, device: str, seed: int, threads: int) -> None:
    torch.set_num_threads(threads)
    dev = torch.device(f"cuda:{rank}" if device == "cuda" else device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend_for(dev), init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size, timeout=GROUP_TIMEOUT)
    try:
        run_worker_rank(ParallelContext.from_group(dev), source, method, dtype, dev, seed, collect_stats=False)
    finally:
        dist.destroy_process_group()


class LocalEP:
    """Rank 0 in the caller's process, ranks 1..N-1 spawned here; `driver` is the model the caller's engine runs."""

    def __init__(self, source: ModelSource, config: EPConfig, dtype: torch.dtype, device: torch.device | str, seed: int, threads: int = 1) -> None:
        if dist.is_initialized():
            raise ValueError("LLM(ep=N) spawns its own ranks, but this process is already in a process group (torchrun?): use `openk3 serve --ep N`")
        if isinstance(source, torch.nn.Module) and not isinstance(source, K3ForCausalLM):
            raise ValueError(f"ep: the model must be a K3ForCausalLM to shard its experts, got {type(source).__name__}")
        if not isinstance(source, torch.nn.Module):
            resolve_model(source)  # a bad name fails here, before any rank starts
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is not None:
            raise ValueError(f"device={str(device)!r} with ep={config.size}: rank r takes GPU r, so name no index (device='cuda')")
        if dev.type == "cuda" and torch.cuda.device_count() < config.size:
            raise ValueError(f"ep={config.size} needs one GPU per rank, {torch.cuda.device_count()} visible")
        port = free_port()
        spawn = mp.get_context("spawn")
        self.workers = [
            spawn.Process(
                target=_local_worker, args=(r, config.size, port, source, config.method, dtype, dev.type, seed, threads), daemon=True, name=f"openk3-ep{r}"
            )
            for r in range(1, config.size)
        ]
        self.module = source if isinstance(source, torch.nn.Module) else None
        self._backends = [moe.backend for moe in self.module.moe_layers()] if isinstance(self.module, K3ForCausalLM) else []
        self.driver: EPDriver | None = None
        try:
            for w in self.workers:
                w.start()
            dist.init_process_group(backend_for(dev), init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=config.size, timeout=GROUP_TIMEOUT)
            ctx = ParallelContext.from_group(dev)
            self.driver, self.backend = start_driver(ctx, source, config.method, dtype, dev, seed, collect_stats=False)
        except BaseException:
            self._teardown(JOIN_TIMEOUT_S)
            raise

    def close(self) -> None:
        """Stop the workers and leave the process group (idempotent); a caller's module gets its own experts back.

        After a failed step the workers are stuck in that step's collectives and cannot read a STOP: they are killed,
        so close() returns in seconds instead of waiting out the group's timeout."""
        if self.driver is not None and self.driver.failed:
            self.driver.close()
            self._teardown(0.0)
            return
        try:
            if dist.is_initialized() and self.driver is not None and not self.driver.closed:
                self.driver.close()
        finally:
            self._teardown(JOIN_TIMEOUT_S)

    def _teardown(self, grace_s: float) -> None:
        """Join the workers within one shared deadline of `grace_s` (0: stop them now), kill what is left, leave the group."""
        started = [w for w in self.workers if w.pid is not None]
        if grace_s <= 0:
            for w in started:
                w.terminate()
            grace_s = KILL_GRACE_S
        deadline = time.monotonic() + grace_s
        for w in started:
            w.join(max(0.0, deadline - time.monotonic()))
        for w in started:
            if w.is_alive():
                w.kill()
                w.join()
        if dist.is_initialized():
            dist.destroy_process_group()
        if isinstance(self.module, K3ForCausalLM):
            for moe, previous in zip(self.module.moe_layers(), self._backends, strict=True):
                moe.backend = previous
