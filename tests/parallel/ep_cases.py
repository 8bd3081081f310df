"""Work run on each spawned rank by the distributed EP tests (module-level so spawn can import it); returns plain numbers."""

from __future__ import annotations

import hashlib
from dataclasses import replace

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
from openk3.parallel.ep.moonep_backend import MoonEPBackend
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
