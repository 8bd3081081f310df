"""Block AttnRes in the model: forward time of the two-phase evaluation ("fast") against the one-shot mix per sublayer ("naive").

Run (after `make venv`, which installs the project):
    .venv/bin/python benchmarks/attn_res.py [--threads 2] [--repeats 5] [--layers 16 24] [--block-sizes 4 8] [--tokens 1 16 256 1024 2048]
A K3-shaped small backbone (tiny(): D=256, KDA + gated MLA every 4th layer and last, LatentMoE with 16 experts) with
--layers layers, fp32, cache-free forward of one sequence of T tokens, hidden states only (no lm_head). Each row builds the
naive and fast models with the same weights plus the same backbone with plain residuals ("plain"); the AttnRes cost of a path
is its time minus plain's. Timings are round-robin over the three models, best of --repeats. A ratio is printed only if fast
matches naive: max abs diff <= 1e-5 * (1 + max |naive|). Two choices keep that check about the AttnRes evaluation rather than
the backbone's conditioning: (1) the pseudo-queries are random at 0.05 (logits of about one unit: a softmax far from uniform,
so a wrong block set or query shows as O(1) errors), where 0.5 turns fp32 rounding into ~1e-2 differences over 16-24 layers
(a 1e-7 relative nudge of the embedding moves naive itself that much); (2) the router's selection bias is 2 * expert index,
so every token picks the same top-k experts: a rounding difference can no longer flip a near-tie top-k choice, which would
move that token by ~0.4 and, through causal attention, every later token. Expert weights still come from the unbiased
scores and the expert matmuls do the same FLOPs, so the timings are those of ordinary routing up to the per-expert split.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time

import torch

from openk3.config import KDAConfig, KDAGate, MLAConfig, ModelConfig, MoEConfig, tiny
from openk3.model import ForwardBatch, K3ForCausalLM, OpChoice


def backbone(layers: int, block_size: int | None, lean: bool) -> ModelConfig:
    mla = tuple(i for i in range(layers) if (i + 1) % 4 == 0 or i == layers - 1)
    config = tiny().replace(num_hidden_layers=layers, mla_layers=mla, attn_res_block_size=block_size)
    if not lean:
        return config
    # same width and layer schedule, sublayers shrunk to a narrow core: the forward is then mostly AttnRes work
    return config.replace(
        kda=KDAConfig(num_heads=1, head_dim=16, gate=KDAGate.LOWER_BOUND, gate_lower_bound=-5.0, full_rank_output_gate=True),
        mla=MLAConfig(num_heads=1, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, output_gate=True),
        moe=MoEConfig(num_experts=4, num_experts_per_token=1, moe_intermediate_size=32, num_shared_experts=1, latent_size=32, latent_norm=True),
        intermediate_size=16,
    )


def build(config: ModelConfig, impl: str, state: dict[str, torch.Tensor] | None) -> K3ForCausalLM:
    model = K3ForCausalLM(config, OpChoice(attn_res=impl))
    if state is None:
        model.init_weights(seed=0)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_res_proj.weight"):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            for moe in model.moe_layers():
                bias = moe.gate.e_score_correction_bias
                bias.copy_(2.0 * torch.arange(bias.numel(), dtype=bias.dtype))
    else:
        model.load_state_dict(state)
    return model.eval()


def best_times(models: dict[str, K3ForCausalLM], batch: ForwardBatch, repeats: int) -> dict[str, float]:
    best = dict.fromkeys(models, float("inf"))
    for _ in range(repeats):
        for name, model in models.items():
            start = time.perf_counter()
            model.model(batch, None)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, nargs="+", default=[16, 24])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 1024, 2048])
    parser.add_argument("--lean", action="store_true", help="shrink the sublayers to a narrow core (AttnRes-dominated forward)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; ", end="")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; commit {commit}")
    lean = ", sublayers lean (narrow core)" if args.lean else ""
    print(f"backbone: tiny() D=256 with L layers{lean}, fp32, one sequence of T tokens, best of {args.repeats} (round-robin)\n")
    print("| L | block | blocks | T | plain ms | naive ms | fast ms | naive / fast | AttnRes cost naive / fast | max abs diff |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ok = True
    g = torch.Generator().manual_seed(2)
    for layers in args.layers:
        plain = build(backbone(layers, None, args.lean), "naive", None)
        for block_size in args.block_sizes:
            naive = build(backbone(layers, block_size, args.lean), "naive", None)
            fast = build(backbone(layers, block_size, args.lean), "fast", naive.state_dict())
            models = {"plain": plain, "naive": naive, "fast": fast}
            n_blocks = -(-layers // block_size) + 1  # + b_0, the embedding
            for tokens in args.tokens:
                batch = ForwardBatch.from_tokens(torch.randint(0, plain.config.vocab_size, (1, tokens), generator=g))
                with torch.no_grad():
                    want, got = naive.model(batch, None), fast.model(batch, None)
                    err = (got - want).abs().max().item()
                    if err > 1e-5 * (1 + want.abs().max().item()):
                        ok = False
                        print(f"| {layers} | {block_size} | {n_blocks} | {tokens} | refused: fast != naive (max abs diff {err:.2e}) |")
                        continue
                    t = best_times(models, batch, args.repeats)
                cost_n, cost_f = t["naive"] - t["plain"], t["fast"] - t["plain"]
                cost = f"{cost_n / cost_f:.2f}x" if cost_n > 0 and cost_f > 0 else "n/a (within noise of plain)"
                row = f"| {layers} | {block_size} | {n_blocks} | {tokens} | {t['plain'] * 1e3:.1f} | {t['naive'] * 1e3:.1f} | {t['fast'] * 1e3:.1f}"
                print(f"{row} | {t['naive'] / t['fast']:.2f}x | {cost} | {err:.1e} |", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
