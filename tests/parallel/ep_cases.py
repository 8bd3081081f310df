"""Work run on each spawned rank by the distributed EP tests (module-level so spawn can import it); returns plain numbers."""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from openk3.config import debug
from openk3.model import CacheTensors, ForwardBatch, K3ForCausalLM
from openk3.model.moe import LatentMoE, LocalExperts
from openk3.ops.moe.bank import DenseExpertBank
from openk3.ops.moe.grouped import moe_experts_grouped
from openk3.ops.moe.packed_bank import PackedMXFP4ExpertBank
from openk3.ops.moe.router import RouterOutput
from openk3.parallel.config import EPMethod
from openk3.parallel.ep.backend import EPBackend, attach_expert_parallel
from openk3.parallel.ep.load_stats import ExpertLoad, eplb_engine_placements, gather_load
from openk3.parallel.ep.moonep_backend import MoonEPBackend
from openk3.parallel.ep.padded import Capacity
from openk3.parallel.ep.placement import LoadCollector, eplb_placement
from openk3.parallel.ep.static_backend import ExpertParallelBackend, gather_placements
from openk3.parallel.group import ParallelContext

ROUTINGS = ("uniform", "zipf", "one_expert", "all_same")


def make_layer(num_experts: int) -> LatentMoE:
    cfg = debug()
    layer = LatentMoE(replace(cfg, moe=replace(cfg.moe, num_experts=num_experts, num_experts_per_token=3)), layer_index=1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return layer.eval()


def make_routing(kind: str, tokens: int, num_experts: int, k: int, seed: int) -> RouterOutput:
    g = torch.Generator().manual_seed(seed)
    noise = torch.rand(tokens, num_experts, generator=g)
    if kind == "zipf":
        # Gumbel top-k over Zipf(1.5) popularity: skewed but still k distinct experts per token.
        noise = -1.5 * torch.log(torch.arange(1, num_experts + 1).float()) - torch.log(-torch.log(noise.clamp_min(1e-9)))
    if kind == "one_expert":
        noise[:, 0] = 2.0
    if kind == "all_same":
        noise = torch.linspace(1, 0, num_experts).expand(tokens, -1).clone()
    idx = torch.topk(noise, k, dim=1).indices
    weight = torch.rand(tokens, k, generator=g) + 0.1
    return RouterOutput(idx, weight, torch.zeros(tokens, num_experts))


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return float((got - want).abs().max()) if got.numel() else 0.0


def moe_cases(ctx: ParallelContext) -> dict[str, float]:
    """Max |EP - single process| per (method, routing), on MoE layers of 2 experts per rank, uneven T (one rank has none)."""
    torch.set_grad_enabled(False)
    num_experts = 2 * ctx.world_size
    layer = make_layer(num_experts)
    dense = layer.experts.bank()
    assert isinstance(dense, DenseExpertBank)
    packed = PackedMXFP4ExpertBank.from_dense(dense.w1_EID, dense.w3_EID, dense.w2_EDI)
    skew = torch.tensor([50.0] + [1.0] * (num_experts - 1))
    collector = LoadCollector(num_experts, window=4)
    errors: dict[str, float] = {}
    for kind in ROUTINGS:
        tokens = 0 if (ctx.rank == 1 and kind == "uniform") else 7 + 5 * ctx.rank
        routing = make_routing(kind, tokens, num_experts, 3, seed=100 * ctx.rank + len(kind))
        collector.observe(layer.layer_index, routing.topk_idx)
        z = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(ctx.rank))
        backends: dict[str, EPBackend] = {
            "ep": ExpertParallelBackend.from_banks(ctx, {1: dense}),
            "eplb": ExpertParallelBackend.from_banks(ctx, {1: dense}, {1: eplb_placement(skew, ctx.world_size, ctx.world_size)}),
            "moonep": MoonEPBackend.from_banks(ctx, {1: dense}),
            "moonep_budget0": MoonEPBackend.from_banks(ctx, {1: dense}, prefetch_budget_bytes=0),
        }
        ref = moe_experts_grouped(z, routing.topk_idx, routing.topk_weight, dense, layer.expert_act)
        for name, backend in backends.items():
            errors[f"{name}/{kind}"] = max_error(backend(layer, z, routing), ref)
            stats = backend.drain_stats()[0]
            if name == "moonep_budget0":
                errors[f"{name}/{kind}/spilled"] = stats.spilled
            if name == "moonep" and stats.spilled == 0:
                errors[f"{name}/{kind}/imbalance"] = max(stats.recv_entries_R) - min(stats.recv_entries_R)
        packed_ref = moe_experts_grouped(z, routing.topk_idx, routing.topk_weight, packed, layer.expert_act)
        moon_packed = MoonEPBackend.from_banks(ctx, {1: packed})
        errors[f"moonep_packed/{kind}"] = max_error(moon_packed(layer, z, routing), packed_ref)
        stats = moon_packed.drain_stats()[0]
        shard = moon_packed.shards[1]
        sent = int(sum(torch.cat([moon_packed.last_plan[1].prefetch_of(d) for d in range(ctx.world_size)]) // 2 == ctx.rank))
        errors[f"moonep_packed/{kind}/prefetch_bytes_mismatch"] = stats.prefetch_bytes - sent * shard.expert_nbytes
    gathered = ExpertParallelBackend.from_banks(ctx, {1: dense}, gather_placements(ctx, collector, [1], ctx.world_size))
    routing = make_routing("zipf", 9, num_experts, 3, seed=ctx.rank)
    z = torch.randn(9, 32, generator=torch.Generator().manual_seed(ctx.rank))
    ref = moe_experts_grouped(z, routing.topk_idx, routing.topk_weight, dense, layer.expert_act)
    errors["eplb_collected/zipf"] = float((gathered(layer, z, routing) - ref).abs().max())
    return errors


def model_cases(ctx: ParallelContext) -> dict[str, float | str]:
    """Max |logits with EP - logits single process| for a whole K3ForCausalLM(debug()) on this rank's own sequences."""
    torch.set_grad_enabled(False)
    model = K3ForCausalLM(debug())
    model.init_weights(seed=0, std=0.1)
    g = torch.Generator().manual_seed(1)
    for moe in model.moe_layers():
        moe.gate.e_score_correction_bias.copy_(torch.randn(moe.gate.e_score_correction_bias.shape, generator=g) * 0.05)
    model.eval()
    tokens = torch.randint(0, model.config.vocab_size, (2, 5 + 2 * ctx.rank), generator=torch.Generator().manual_seed(10 + ctx.rank))
    ref = model.forward_tokens(tokens)
    layers = model.moe_layers()
    hot = torch.tensor([20.0] + [1.0] * (model.config.moe.num_experts - 1))
    eplb = {m.layer_index: eplb_placement(hot, ctx.world_size, ctx.world_size) for m in layers}
    backends: dict[str, EPBackend] = {
        "ep": ExpertParallelBackend.from_layers(ctx, layers),
        "eplb": ExpertParallelBackend.from_layers(ctx, layers, eplb),
        "moonep": MoonEPBackend.from_layers(ctx, layers),
    }
    errors: dict[str, float | str] = {}
    for name, backend in backends.items():
        model.set_expert_backend(backend)
        errors[name] = float((model.forward_tokens(tokens) - ref).abs().max())
        errors[f"{name}/stats_layers"] = len(backend.drain_stats()) - len(layers)
    # Replicated attention: every rank runs rank 0's batch and must produce rank 0's single-process logits.
    shared = torch.randint(0, model.config.vocab_size, (3, 7), generator=torch.Generator().manual_seed(99))
    model.set_expert_backend(LocalExperts())
    shared_ref = model.forward_tokens(shared)
    for method in EPMethod:
        attach_expert_parallel(model, ctx, method, replicated_tokens=True, placements=eplb)
        logits = model.forward_tokens(shared)
        errors[f"replicated_{method.value}"] = float((logits - shared_ref).abs().max())
        errors[f"replicated_{method.value}/digest"] = hashlib.sha256(logits.numpy().tobytes()).hexdigest()
    # Greedy decode through the cache, one token per step: fewer tokens than ranks, so TokenSplit leaves ranks empty.
    # Replicated attention needs the same batch on every rank; data-parallel ranks each decode their own prompt.
    prompts = {
        feed: torch.randint(0, model.config.vocab_size, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
        for feed, seed in (("replicated", 7), ("dp", 8 + ctx.rank))
    }
    model.set_expert_backend(LocalExperts())
    wanted = {feed: greedy(model, prompt, 6) for feed, prompt in prompts.items()}
    for method in EPMethod:
        for replicated in (True, False):
            feed = "replicated" if replicated else "dp"
            prompt, (want_tokens, want_logits) = prompts[feed], wanted[feed]
            attach_expert_parallel(model, ctx, method, replicated_tokens=replicated, placements=eplb)
            tokens_out, logits = greedy(model, prompt, 6)
            name = f"greedy_{feed}_{method.value}"
            errors[name] = float((logits - want_logits).abs().max())
            errors[f"{name}/mismatched_tokens"] = sum(a != b for a, b in zip(tokens_out, want_tokens, strict=True))
    return errors


def greedy(model: K3ForCausalLM, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    cache = CacheTensors.allocate(model.config, num_slots=1, num_pages=8, page_size=8)
    table = torch.arange(8).view(1, 8)
    out, logits_out, tokens, pos = [], [], prompt, 0
    for _ in range(steps):
        logits = model(ForwardBatch.for_step([tokens], [pos], [0], table), cache)
        pos += len(tokens)
        tokens = [int(logits[0].argmax())]
        out.append(tokens[0])
        logits_out.append(logits)
    return out, torch.cat(logits_out)


def all_cases(ctx: ParallelContext) -> dict[str, float | str]:
    return {**{f"moe/{k}": v for k, v in moe_cases(ctx).items()}, **{f"model/{k}": v for k, v in model_cases(ctx).items()}}


class DistCalls:
    """Counts the torch.distributed collectives really issued, to check the backends' own tally against."""

    NAMES = ("all_to_all_single", "all_gather", "all_gather_into_tensor", "all_reduce", "broadcast")

    def __init__(self) -> None:
        self.calls = 0
        self._saved = {name: getattr(torch.distributed, name) for name in self.NAMES}

    def __enter__(self) -> DistCalls:
        for name, fn in self._saved.items():
            setattr(torch.distributed, name, self._wrap(fn))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._saved.items():
            setattr(torch.distributed, name, fn)

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return fn(*args, **kwargs)

        return counted


def drop_beyond_capacity(topk_idx: torch.Tensor, weight: torch.Tensor, slots: int) -> tuple[torch.Tensor, int]:
    """Weights with every entry past the first `slots` of its expert (flattened token order) set to 0; plain EP placement."""
    seen: dict[int, int] = {}
    out = weight.clone().reshape(-1)
    dropped = 0
    for i, e in enumerate(topk_idx.reshape(-1).tolist()):
        seen[e] = seen.get(e, 0) + 1
        if seen[e] > slots:
            out[i] = 0.0
            dropped += 1
    return out.view_as(weight), dropped


def exchange_cases(ctx: ParallelContext) -> dict[str, float]:
    """Collectives and host reads per layer (tally and real torch.distributed calls), the fixed-capacity exchange against
    the exact one with and without drops."""
    torch.set_grad_enabled(False)
    num_experts = 2 * ctx.world_size
    layer = make_layer(num_experts)
    dense = layer.experts.bank()
    out: dict[str, float] = {}
    tokens = 6 + 3 * ctx.rank
    routing = make_routing("zipf", tokens, num_experts, 3, seed=7 + ctx.rank)
    z = torch.randn(tokens, 32, generator=torch.Generator().manual_seed(20 + ctx.rank))
    ref = moe_experts_grouped(z, routing.topk_idx, routing.topk_weight, dense, layer.expert_act)
    skew = torch.tensor([50.0] + [1.0] * (num_experts - 1))
    roomy = Capacity(factor=float(num_experts), max_tokens=16)  # C = max_tokens: nothing can drop
    backends: dict[str, EPBackend] = {
        "ep": ExpertParallelBackend.from_banks(ctx, {1: dense}),
        "eplb": ExpertParallelBackend.from_banks(ctx, {1: dense}, {1: eplb_placement(skew, ctx.world_size, ctx.world_size)}),
        "moonep": MoonEPBackend.from_banks(ctx, {1: dense}),
        "padded": ExpertParallelBackend.from_banks(ctx, {1: dense}, capacity=roomy),
        "padded_eplb": ExpertParallelBackend.from_banks(ctx, {1: dense}, {1: eplb_placement(skew, ctx.world_size, ctx.world_size)}, capacity=roomy),
    }
    exact = backends["ep"](layer, z, routing)
    backends["ep"].drain_stats()
    for name, backend in backends.items():
        backend.collect_stats = False
        with DistCalls() as calls:
            y = backend(layer, z, routing)
        out[f"{name}/real_collectives"] = calls.calls
        out[f"{name}/error"] = max_error(y, ref)
        out[f"{name}/vs_exact"] = max_error(y, exact)
        backend.collect_stats = True
        backend(layer, z, routing)
        stats = backend.drain_stats()[0]
        out[f"{name}/collectives"] = stats.collectives
        out[f"{name}/host_reads"] = stats.host_reads
        out[f"{name}/dropped"] = stats.dropped
    # A tight capacity: 1 slot per (source, expert); the dropped entries contribute zero, the rest is exact.
    tight = Capacity(factor=1.0 / 16, max_tokens=16)
    slots = tight.slots(3, num_experts)
    backend = ExpertParallelBackend.from_banks(ctx, {1: dense}, capacity=tight)
    kept_weight, dropped = drop_beyond_capacity(routing.topk_idx, routing.topk_weight, slots)
    kept_ref = moe_experts_grouped(z, routing.topk_idx, kept_weight, dense, layer.expert_act)
    out["tight/error"] = max_error(backend(layer, z, routing), kept_ref)
    out["tight/dropped"] = backend.drain_stats()[0].dropped
    out["tight/expected_dropped"] = dropped
    # Data-parallel ranks each see their own tokens (here counted by the MoonEP backend); the exported load is the sum.
    collector = LoadCollector(num_experts, window=4)
    MoonEPBackend.from_banks(ctx, {1: dense}, collect_stats=False, collector=collector)(layer, z, routing)
    gathered = gather_load(ctx, collector).layers[1]
    for e in range(num_experts):
        out[f"load/local/{e}"] = int(collector.load(1)[e])
        out[f"load/gathered/{e}"] = int(gathered[e])
    # EPLB placed from a measured load file (every rank reads the same counts, so places the same replicas).
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "load.json"
        ExpertLoad(num_experts, 4, {1: gathered}).save(path)
        from_file = eplb_engine_placements([1], num_experts, ctx.world_size, path, redundant_fraction=0.5)
    placed = ExpertParallelBackend.from_banks(ctx, {1: dense}, from_file)
    out["eplb_file/error"] = max_error(placed(layer, z, routing), ref)
    out["eplb_file/hot_replicas"] = int(from_file[1].replica_counts()[int(torch.argmax(gathered))])
    out.update(padded_greedy_case(ctx))
    return out


def padded_greedy_case(ctx: ParallelContext) -> dict[str, float]:
    """Greedy decoding of a debug model with the fixed-capacity exchange (data-parallel ranks, replicated tokens)."""
    model = K3ForCausalLM(debug())
    model.init_weights(seed=0, std=0.1)
    model.eval()
    num_experts = model.config.moe.num_experts
    out: dict[str, float] = {}
    for feed, seed in (("replicated", 7), ("dp", 8 + ctx.rank)):
        prompt = torch.randint(0, model.config.vocab_size, (5,), generator=torch.Generator().manual_seed(seed)).tolist()
        model.set_expert_backend(LocalExperts())
        want_tokens, want_logits = greedy(model, prompt, 6)
        collector = LoadCollector(num_experts, window=64)
        attach_expert_parallel(model, ctx, EPMethod.EP, replicated_tokens=feed == "replicated", capacity=Capacity(float(num_experts), 8), collector=collector)
        tokens_out, logits = greedy(model, prompt, 6)
        out[f"padded_greedy_{feed}"] = max_error(logits, want_logits)
        out[f"padded_greedy_{feed}/mismatched_tokens"] = sum(a != b for a, b in zip(tokens_out, want_tokens, strict=True))
        out[f"padded_greedy_{feed}/observed_entries"] = int(sum(collector.load(i).sum() for i in collector.layers()))
    return out
