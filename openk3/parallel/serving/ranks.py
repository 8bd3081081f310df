"""One rank's start-up in expert-parallel serving, the same on every rank because group creation is collective: open the
step channel (its own gloo group), build this rank's model (trunk + its experts only, rank_model.py), report the outcome
in a handshake (so a rank that failed is reported by rank 0 and the others leave), then rank 0 wraps its model in an
EPDriver for its engine while the others run the worker loop until rank 0 closes the driver.

Used by both ways of starting the ranks: LocalEP (this process is rank 0, the workers are spawned here) and torchrun
(`openk3 serve --ep N`, one process per rank).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from openk3.config import preset
from openk3.model.model import K3ForCausalLM
from openk3.parallel.ep.backend import TokenSplit
from openk3.parallel.group import ParallelContext
from openk3.parallel.serving.driver import EPDriver, run_worker
from openk3.parallel.serving.rank_model import attach_rank_experts, engine_placements, load_rank_model
from openk3.parallel.serving.step_channel import StepChannel
from openk3.serve.loading import resolve_model
from openk3.serve.prepare import prepare_for_serving

ModelSource = str | Path | torch.nn.Module


@dataclass(frozen=True)
class RankModelSpec:
    """What every rank needs to build its part of the model; the same on every rank (the device is each rank's own)."""

    source: ModelSource
    method: str
    dtype: torch.dtype
    seed: int
    collect_stats: bool


def build_rank_model(spec: RankModelSpec, ctx: ParallelContext) -> tuple[K3ForCausalLM, TokenSplit]:
    """This rank's model with the expert-parallel backend attached, in the serving layout (serve/prepare.py; the same on
    every rank). A checkpoint folder is read per rank (own experts only); a preset without a checkpoint is built from its
    seed on every rank, then cut; a module is cut (rank 0 copies its shard, so the caller's module keeps its experts)."""
    model, backend = _rank_model(spec, ctx)
    prepare_for_serving(model, ctx.device)
    return model, backend


def _rank_model(spec: RankModelSpec, ctx: ParallelContext) -> tuple[K3ForCausalLM, TokenSplit]:
    source, method = spec.source, spec.method
    if isinstance(source, torch.nn.Module):
        if not isinstance(source, K3ForCausalLM):
            raise ValueError(f"ep: the model must be a K3ForCausalLM to shard its experts, got {type(source).__name__}")
        layers = [moe.layer_index for moe in source.moe_layers()]
        placements = engine_placements(layers, source.config.moe.num_experts, ctx.world_size, method)
        backend = attach_rank_experts(source, ctx, method, placements, loaded_per_rank=False, drop_full_banks=ctx.rank != 0, collect_stats=spec.collect_stats)
        return source, backend
    folder = resolve_model(source)
    if folder is not None:
        return load_rank_model(folder, ctx, method, spec.dtype, ctx.device, spec.collect_stats)
    config = preset(str(source))
    net = K3ForCausalLM(config)
    net.init_weights(spec.seed)
    net = net.to(device=ctx.device, dtype=spec.dtype).eval()
    placements = engine_placements([moe.layer_index for moe in net.moe_layers()], config.moe.num_experts, ctx.world_size, method)
    return net, attach_rank_experts(net, ctx, method, placements, loaded_per_rank=False, drop_full_banks=True, collect_stats=spec.collect_stats)


def _failure(rank: int, error: BaseException) -> str:
    return f"rank {rank}: {type(error).__name__}: {error}"


def run_worker_rank(ctx: ParallelContext, spec: RankModelSpec) -> int:
    """A worker rank from joining to STOP: channel, model, start-up handshake, loop; returns the steps it ran (0 when
    some rank failed to start: rank 0 reports that)."""
    channel = StepChannel(ctx)
    try:
        model, backend = build_rank_model(spec, ctx)
    except Exception as e:
        channel.report_ready(_failure(ctx.rank, e))
        raise
    if any(channel.report_ready(None)):
        return 0
    return run_worker(model, channel, ctx.device, backend)


def start_driver(ctx: ParallelContext, spec: RankModelSpec) -> tuple[EPDriver, TokenSplit]:
    """Rank 0's side of the start-up: the channel, its model, the handshake, and the driver the engine is given in place
    of the model. Raises this rank's own error, else the first worker's that failed to build its model."""
    channel = StepChannel(ctx)
    try:
        model, backend = build_rank_model(spec, ctx)
    except Exception as e:
        # the workers wait in the handshake: tell them to leave rather than wait for a first step
        with contextlib.suppress(RuntimeError):
            channel.report_ready(_failure(0, e))
        raise
    failures = [f for f in channel.report_ready(None) if f is not None]
    if failures:
        raise RuntimeError(f"expert-parallel start-up failed on {len(failures)} rank(s): " + "; ".join(failures))
    return EPDriver(model, channel, backend.inner), backend
