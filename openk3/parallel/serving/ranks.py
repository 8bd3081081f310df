"""One rank's start-up in multi-rank serving, the same on every rank because group creation is collective: open the
step channel (its own gloo group), build this rank's model (its tensor-parallel shard of the trunk, and its experts only
with expert parallelism: rank_model.py, openk3.parallel.tp), report the outcome
in a handshake (so a rank that failed is reported by rank 0 and the others leave), then rank 0 wraps its model in an
EPDriver for its engine while the others run the worker loop until rank 0 closes the driver.

Used by both ways of starting the ranks: LocalEP (this process is rank 0, the workers are spawned here) and torchrun
(`openk3 serve --ep N`, one process per rank).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from openk3.config import ModelConfig, config_from_hf, preset
from openk3.model.model import K3ForCausalLM
from openk3.model.weights import load_model
from openk3.parallel.config import ParallelConfig
from openk3.parallel.cp.step_model import ContextParallelStep
from openk3.parallel.ep.backend import EPBackend, TokenSplit
from openk3.parallel.ep.placement import redundant_for
from openk3.parallel.ep.rebalance import RebalanceConfig
from openk3.parallel.group import ParallelContext
from openk3.parallel.layout import ExpertLayout, ServingPlan, TensorParallelCut, apply_serving_layout
from openk3.parallel.serving.driver import EPDriver, run_worker
from openk3.parallel.serving.heartbeat import RankHeartbeat, exit_worker
from openk3.parallel.serving.rank_groups import ContextParallelGroups, context_parallel_groups
from openk3.parallel.serving.rank_model import EPLB_REDUNDANT_FRACTION, engine_placements, rank_expert_ids
from openk3.parallel.serving.step_channel import StepChannel
from openk3.serve.loading import resolve_model
from openk3.serve.op_names import parse_op_names

ModelSource = str | Path | torch.nn.Module


@dataclass(frozen=True)
class RankModelSpec:
    """What every rank needs to build its part of the model; the same on every rank (the device is each rank's own)."""

    source: ModelSource
    method: str
    dtype: torch.dtype
    seed: int
    collect_stats: bool
    eplb_stats: str | None  # method eplb: the measured load file every rank places its replicas from (--eplb-stats)
    tp: int = 1  # ranks of a tensor-parallel group (the world when dp = 1 and cp = 1)
    ep: bool = True  # experts sharded by expert over every rank (else, with tp > 1, every expert split by width)
    dp: int = 1  # > 1: data-parallel attention, dp groups of tp ranks, each group its own engine and tokens
    ops: str | None = None  # EngineConfig.ops: the implementations every rank selects for its shard (serve/op_names.py)
    heartbeat_timeout_s: float = 5.0  # ParallelConfig.heartbeat_timeout_s: a rank silent this long is lost (heartbeat.py)
    eplb_interval_steps: int | None = None  # method eplb: re-place the experts every N steps from the live load (ep/rebalance.py)
    cp: int = 1  # > 1: context parallel, cp groups of tp ranks, long prefill steps split by position (cp/step_model.py)
    cp_min_tokens: int = 256
    kda_cp: str = "sequential"  # ParallelConfig.kda_cp: "scan" runs every CP rank's KDA recurrence at once (cp/kda_scan.py)
    decode_cp: bool = False  # cp > 1: every rank's MLA pages hold its share of the latents (cp/sharded_mla.py)
    disk_dir: str | None = None  # EngineConfig.disk_offload_dir: a worker holding shards keeps its share of the disk tier there

    @classmethod
    def of(
        cls, source: ModelSource, parallel: ParallelConfig, dtype: torch.dtype, seed: int, collect_stats: bool, *, ops: str | None, disk_dir: str | None = None
    ) -> RankModelSpec:
        """The spec of a layout as ParallelConfig declares it, with the engine's named ops (every entry point builds it here,
        so none drops a setting; the driver's engine runs the model as its ranks prepared it)."""
        return cls(
            source,
            parallel.ep_method,
            dtype,
            seed,
            collect_stats,
            parallel.eplb_stats,
            tp=parallel.tp,
            ep=parallel.ep > 1,
            dp=parallel.dp,
            ops=ops,
            heartbeat_timeout_s=parallel.heartbeat_timeout_s,
            eplb_interval_steps=parallel.eplb_interval_steps,
            cp=parallel.cp,
            cp_min_tokens=parallel.cp_min_tokens,
            kda_cp=parallel.kda_cp,
            decode_cp=parallel.decode_cp,
            disk_dir=disk_dir,
        )


def build_rank_model(spec: RankModelSpec, ctx: ParallelContext, tp_ctx: ParallelContext | None = None) -> tuple[K3ForCausalLM, TokenSplit | EPBackend | None]:
    """This rank's model (and its expert-parallel backend, None without expert parallelism), laid out for serving with
    the spec's named ops (parallel/layout.py; the same on every rank). `ctx`: every rank (the experts are spread over them); `tp_ctx`: this
    rank's tensor-parallel group, whose ranks hold the same tokens (default: `ctx` itself for one engine over every
    rank, a group of one with data-parallel attention; rank_groups.py). A checkpoint folder is read per rank (own
    shard and experts only); a preset without a checkpoint is built from its seed on every rank, then cut; a module is
    cut (rank 0 cuts a copy or copies its expert shard, so the caller's module keeps its weights)."""
    tp_ctx = tp_ctx or (ctx if spec.dp == 1 else ParallelContext.single(ctx.device))
    if spec.tp > 1 and spec.tp != tp_ctx.world_size:
        raise ValueError(f"tensor parallel: tp={spec.tp} but the tensor-parallel group has {tp_ctx.world_size} ranks")
    if spec.dp > 1 and (spec.dp * spec.tp != ctx.world_size or not spec.ep):
        raise ValueError(f"data-parallel attention: dp={spec.dp} x tp={spec.tp} ranks with ep, got {ctx.world_size} ranks, ep={spec.ep}")
    source = spec.source
    if isinstance(source, torch.nn.Module):
        if not isinstance(source, K3ForCausalLM):
            raise ValueError(f"ep/tp: the model must be a K3ForCausalLM to shard it, got {type(source).__name__}")
        # the workers hold their own (pickled) copy; rank 0 must not cut the caller's module, nor take its experts
        model = copy.deepcopy(source) if spec.tp > 1 and ctx.rank == 0 else source
        plan = _serving_plan(spec, model.config, ctx, tp_ctx, drop_full_banks=spec.tp > 1 or ctx.rank != 0)
        return model, apply_serving_layout(model, plan)
    folder = resolve_model(source)
    if folder is not None:
        plan = _serving_plan(spec, config_from_hf(Path(folder)), ctx, tp_ctx, drop_full_banks=True)
        experts = rank_expert_ids(plan.experts.placements, ctx.rank) if plan.experts is not None else None
        cut = plan.tensor_parallel.apply if plan.tensor_parallel is not None else None
        model = load_model(folder, dtype=spec.dtype, device=ctx.device, experts=experts, layout=cut)
        return model, apply_serving_layout(model, plan.loaded())
    model = K3ForCausalLM(preset(str(source)))
    model.init_weights(spec.seed)
    model = model.to(device=ctx.device, dtype=spec.dtype).eval()
    return model, apply_serving_layout(model, _serving_plan(spec, model.config, ctx, tp_ctx, drop_full_banks=True))


def _serving_plan(spec: RankModelSpec, config: ModelConfig, ctx: ParallelContext, tp_ctx: ParallelContext, drop_full_banks: bool) -> ServingPlan:
    cut = TensorParallelCut(tp_ctx, split_experts=not spec.ep) if spec.tp > 1 else None
    experts = None
    if spec.ep:
        layers = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
        num_experts = config.moe.num_experts
        placements = engine_placements(layers, num_experts, ctx.world_size, spec.method, spec.eplb_stats, spec.eplb_interval_steps is not None)
        # the ranks of tp_ctx run the same tokens (TokenSplit hands each its share to dispatch); alone, a rank dispatches its own
        replicated = tp_ctx.world_size > 1
        rebalance = None
        if spec.eplb_interval_steps is not None:
            rebalance = RebalanceConfig(spec.eplb_interval_steps, redundant_for(num_experts, ctx.world_size, EPLB_REDUNDANT_FRACTION))
        experts = ExpertLayout(ctx, spec.method, placements, tp_ctx, replicated, spec.collect_stats, drop_full_banks=drop_full_banks, rebalance=rebalance)
    return ServingPlan(ctx.device, cut, experts, ops=parse_op_names(spec.ops))


def _failure(rank: int, error: BaseException) -> str:
    return f"rank {rank}: {type(error).__name__}: {error}"


def run_worker_rank(ctx: ParallelContext, spec: RankModelSpec) -> int:
    """A worker rank from joining to STOP: channel, model, start-up handshake, loop; returns the steps it ran (0 when
    some rank failed to start: rank 0 reports that)."""
    channel = StepChannel(ctx)
    groups = _cp_groups(spec, ctx)
    heartbeat = RankHeartbeat(ctx.rank, spec.heartbeat_timeout_s)
    try:
        model, backend = build_rank_model(spec, ctx, groups.tp if groups is not None else None)
    except Exception as e:
        channel.report_ready(_failure(ctx.rank, e))
        raise
    if any(channel.report_ready(None)):
        return 0
    heartbeat.on_lost(exit_worker)  # this rank's main thread may be stuck in a collective with the lost rank
    heartbeat.start()
    steps = run_worker(_step_model(spec, model, groups), channel, ctx.device, backend, spec.disk_dir)
    heartbeat.stop()  # rank 0 stopped every heartbeat before its STOP: this returns within a round
    return steps


def start_driver(ctx: ParallelContext, spec: RankModelSpec) -> tuple[EPDriver, TokenSplit | None]:
    """Rank 0's side of the start-up: the channel, its model, the handshake, and the driver the engine is given in place
    of the model. Raises this rank's own error, else the first worker's that failed to build its model."""
    channel = StepChannel(ctx)
    groups = _cp_groups(spec, ctx)
    heartbeat = RankHeartbeat(ctx.rank, spec.heartbeat_timeout_s)
    try:
        model, backend = build_rank_model(spec, ctx, groups.tp if groups is not None else None)
    except Exception as e:
        # the workers wait in the handshake: tell them to leave rather than wait for a first step
        with contextlib.suppress(RuntimeError):
            channel.report_ready(_failure(0, e))
        raise
    failures = [f for f in channel.report_ready(None) if f is not None]
    if failures:
        raise RuntimeError(f"multi-rank start-up failed on {len(failures)} rank(s): " + "; ".join(failures))
    if not isinstance(backend, TokenSplit | None) and spec.cp == 1:
        raise ValueError("start_driver: rank 0 drives replicated attention only; data-parallel attention starts with start_dp_leader")
    # with cp > 1 and tp = 1 each rank dispatches its own tokens (a split step's shard differs per rank): the backend itself
    stats = backend.inner if isinstance(backend, TokenSplit) else backend
    # tp = 1 without decode CP: every rank's pools are rank 0's contents (CP and EP replicate attention), so tier loads
    # can be replayed
    driver = EPDriver(_step_model(spec, model, groups), channel, stats, heartbeat.start(), replicas=spec.tp == 1 and not spec.decode_cp)
    return driver, backend if isinstance(backend, TokenSplit) else None


def _cp_groups(spec: RankModelSpec, ctx: ParallelContext) -> ContextParallelGroups | None:
    """With cp > 1 this rank's TP and CP groups (collective: every rank makes them, after the step channel), else None."""
    return context_parallel_groups(ctx, spec.cp, spec.tp) if spec.cp > 1 else None


def _step_model(spec: RankModelSpec, model: K3ForCausalLM, groups: ContextParallelGroups | None) -> K3ForCausalLM | ContextParallelStep:
    """What each rank runs on a broadcast step: the model, or with cp > 1 its context-parallel step form over its CP group."""
    return ContextParallelStep(model, groups.cp, spec.cp_min_tokens, spec.decode_cp, kda_scan=spec.kda_cp == "scan") if groups is not None else model
