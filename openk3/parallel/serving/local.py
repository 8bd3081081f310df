"""`LLM(..., ep=N)` / `LLM(..., tp=N)`: multi-rank serving in one call. The caller's process is rank 0 and drives its
engine, N - 1 workers are spawned here (torch.multiprocessing; gloo on CPU, or one GPU per rank); each rank starts as ranks.py says.

The caller's process joins a default process group for the LLM's lifetime, so it must not be in one already (under
torchrun, use `openk3 serve --ep N`, torchrun.py). As with any spawn, the caller's script needs an
`if __name__ == "__main__":` guard; without one (or whenever a worker dies during start-up) LLM raises at once, naming the
rank, its exit code and its last error (spawned.py), instead of waiting for a rank that will never join.
"""

from __future__ import annotations

import datetime
import time
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from openk3.model.model import K3ForCausalLM
from openk3.parallel.config import ParallelConfig
from openk3.parallel.dp.engine import DataParallelEngine
from openk3.parallel.launch import free_port, join_group, rank_device
from openk3.parallel.serving.dp_ranks import run_dp_worker_rank, start_dp_leader
from openk3.parallel.serving.driver import EPDriver
from openk3.parallel.serving.ranks import ModelSource, RankModelSpec, run_worker_rank, start_driver
from openk3.parallel.serving.spawned import RankStartError, SpawnedRanks, report_error, report_started
from openk3.serve.config import EngineConfig
from openk3.serve.loading import resolve_model
from openk3.serve.tokenizer import Tokenizer

JOIN_TIMEOUT_S = 60.0  # all workers together, after STOP
KILL_GRACE_S = 5.0  # after SIGTERM to workers stuck in a failed step


def _local_worker(
    rank: int, size: int, port: int, spec: RankModelSpec, device: str, threads: int, timeout_s: float, engine: EngineConfig | None, report: Connection
) -> None:
    report_started(report)
    try:
        torch.set_num_threads(threads)
        timeout = datetime.timedelta(seconds=timeout_s)
        ctx = join_group(rank, size, f"tcp://127.0.0.1:{port}", rank_device(device, rank), timeout)
        try:
            if engine is not None:
                run_dp_worker_rank(ctx, spec, engine, timeout)
            else:
                run_worker_rank(ctx, spec)
        finally:
            dist.destroy_process_group()
    except BaseException as e:
        report_error(report, e)
        raise


class LocalEP:
    """Rank 0 in the caller's process, ranks 1..N-1 spawned here; `driver` is the model the caller's engine runs, or with
    data-parallel attention (dp > 1) `dp_engine` is the engine the caller steps (every rank runs an engine of `engine`'s
    settings; rank 0's uses `tokenizer`)."""

    def __init__(
        self,
        source: ModelSource,
        config: ParallelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        seed: int,
        engine: EngineConfig | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        if dist.is_initialized():
            raise ValueError("LLM(ep=N) spawns its own ranks, but this process is already in a process group (torchrun?): use `openk3 serve --ep N`")
        if isinstance(source, torch.nn.Module) and not isinstance(source, K3ForCausalLM):
            raise ValueError(f"ep/tp: the model must be a K3ForCausalLM to shard it, got {type(source).__name__}")
        world = config.world_size
        if not isinstance(source, torch.nn.Module):
            resolve_model(source)  # a bad name fails here, before any rank starts
        dev = torch.device(device)  # the caller has checked the settings together (ParallelConfig.check_engine: no cuda:N)
        if dev.type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(f"tp={config.tp}, ep={config.ep} needs one GPU per rank ({world}), {torch.cuda.device_count()} visible")
        port = free_port()
        if config.dp > 1 and (engine is None or tokenizer is None):
            raise ValueError("LocalEP: data-parallel attention (dp > 1) runs an engine on every rank: give its EngineConfig and rank 0's tokenizer")
        ops, disk_dir = (engine.ops, engine.disk_offload_dir) if engine is not None else (None, None)
        spec = RankModelSpec.of(source, config, dtype, seed, collect_stats=False, ops=ops, disk_dir=disk_dir)
        worker_engine = engine if config.dp > 1 else None
        spawn = mp.get_context("spawn")
        pipes = [spawn.Pipe(duplex=False) for _ in range(1, world)]
        self.workers = [
            spawn.Process(
                target=_local_worker,
                args=(r, world, port, spec, dev.type, config.ep_threads, config.ep_timeout_s, worker_engine, pipes[r - 1][1]),
                daemon=True,
                name=f"openk3-ep{r}",
            )
            for r in range(1, world)
        ]
        self.spawned = SpawnedRanks(self.workers, [read for read, _ in pipes])
        self.module = source if isinstance(source, torch.nn.Module) else None
        self._backends = [moe.backend for moe in self.module.moe_layers()] if isinstance(self.module, K3ForCausalLM) else []
        self.driver: EPDriver | None = None
        self.dp_engine: DataParallelEngine | None = None
        try:
            for w in self.workers:
                w.start()
            for _, write in pipes:
                write.close()  # the workers hold theirs: a worker's end closes its pipe
            # nobody joins the group before every worker runs: one that died first is reported now, not waited for
            self.spawned.wait_started(config.ep_timeout_s)
            # start-up and each collective wait at most ep_timeout_s: a worker that died is reported, not waited for forever
            ctx = join_group(0, world, f"tcp://127.0.0.1:{port}", rank_device(dev, 0), datetime.timedelta(seconds=config.ep_timeout_s))
            if config.dp > 1:
                assert engine is not None and tokenizer is not None
                self.dp_engine = start_dp_leader(ctx, spec, engine, tokenizer, datetime.timedelta(seconds=config.ep_timeout_s))
                heartbeat = self.dp_engine.heartbeat
            else:
                self.driver, self.backend = start_driver(ctx, spec)
                heartbeat = self.driver.heartbeat
            if heartbeat is not None:
                # a stopped worker would hold rank 0's step for ep_timeout_s: killed, its sockets close and the step fails now
                heartbeat.on_lost(lambda error: self._kill_workers())
        except RankStartError:
            self._teardown(0.0)
            raise
        except BaseException as e:
            self._teardown(JOIN_TIMEOUT_S)
            # a bare gloo or store error (a peer closed its sockets) says nothing of why; the dead worker's own report does
            dead = self.spawned.dead_report() if isinstance(e, dist.DistError | TimeoutError | ConnectionError) else None
            if dead is not None:
                raise RankStartError(f"multi-rank start-up failed: {dead} ({type(e).__name__}: {e})") from e
            raise

    def close(self) -> None:
        """Stop the workers and leave the process group (idempotent); a caller's module gets its own experts back.

        After a failed step the workers are stuck in that step's collectives and cannot read a STOP: they are killed,
        so close() returns in seconds instead of waiting out the group's timeout."""
        failed = (self.driver is not None and self.driver.failed) or (self.dp_engine is not None and self.dp_engine.failed)
        if failed:
            for stopper in (self.driver, self.dp_engine):
                if stopper is not None:
                    stopper.close()  # sends nothing once failed
            self._teardown(0.0)
            return
        try:
            if dist.is_initialized() and self.driver is not None and not self.driver.closed:
                self.driver.close()
            if dist.is_initialized() and self.dp_engine is not None:
                self.dp_engine.close()
        finally:
            self._teardown(JOIN_TIMEOUT_S)

    def _kill_workers(self) -> None:
        for w in self.workers:
            if w.pid is not None and w.exitcode is None:
                w.kill()

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
