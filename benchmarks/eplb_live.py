"""EPLB re-placed while serving (issue 36 item 6, parallel/ep/rebalance.py): the ranks' expert load before and after.

One MoE layer (the debug model's shapes, E experts, 10 % redundant slots) on W gloo ranks, `--calls` calls of `--tokens`
tokens per rank. Every token takes one hot expert and k - 1 others at random; the hot expert is expert 2 for the first
half of the calls, then the last expert. The backend starts from an even placement and re-places every `--interval`
calls from the last `--interval` calls' load. Per phase of `--interval` calls: the measured max/mean of the entries
each rank computed (EPStats, the mean over the phase's calls), under the placement the phase was served by; the outputs
are checked against one process's at every call (the table is refused otherwise). The last column: the window's rank
max/mean under the old placement -> the one kept, the experts moved, and that call's time (the all-gather of counts,
the placement, the all-to-all of expert bytes, then the call itself), against a plain call's median.

  .venv/bin/python benchmarks/eplb_live.py
  .venv/bin/python benchmarks/eplb_live.py --world 4 --calls 60 --interval 10
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import torch

from openk3.config import debug
from openk3.model.moe import LatentMoE
from openk3.ops.moe.bank import DenseExpertBank
from openk3.ops.moe.grouped import moe_experts_grouped
from openk3.ops.moe.router import RouterOutput
from openk3.parallel.ep.placement import eplb_placement, redundant_for
from openk3.parallel.ep.rebalance import LiveRebalance, RebalanceConfig
from openk3.parallel.ep.static_backend import ExpertParallelBackend
from openk3.parallel.group import ParallelContext
from openk3.parallel.launch import run_ranks

ROOT = Path(__file__).resolve().parents[1]
K = 4


def routing(hot: int, tokens: int, num_experts: int, seed: int) -> RouterOutput:
    g = torch.Generator().manual_seed(seed)
    noise = torch.rand(tokens, num_experts, generator=g)
    noise[:, hot] += 2.0
    return RouterOutput(torch.topk(noise, K, dim=1).indices, torch.rand(tokens, K, generator=g) + 0.1, torch.zeros(tokens, num_experts))


def work(ctx: ParallelContext, num_experts: int, tokens: int, calls: int, interval: int) -> dict[str, object]:
    torch.set_grad_enabled(False)
    cfg = debug()
    layer = LatentMoE(replace(cfg, moe=replace(cfg.moe, num_experts=num_experts, num_experts_per_token=K)), layer_index=1).eval()
    g = torch.Generator().manual_seed(0)
    for p in layer.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    dense = layer.experts.bank()
    assert isinstance(dense, DenseExpertBank)
    redundant = redundant_for(num_experts, ctx.world_size, 0.1)
    backend = ExpertParallelBackend.from_banks(ctx, {1: dense}, {1: eplb_placement(torch.ones(num_experts), ctx.world_size, redundant)})
    backend.rebalance = LiveRebalance(RebalanceConfig(interval, redundant), num_experts)
    width = dense.w1_EID.shape[2]
    error, imbalance, seconds = 0.0, [], []
    for call in range(calls):
        hot = 2 if call < calls // 2 else num_experts - 1
        r = routing(hot, tokens, num_experts, seed=1000 * call + ctx.rank)
        z = torch.randn(tokens, width, generator=torch.Generator().manual_seed(7 * call + ctx.rank))
        t = time.perf_counter()
        y = backend(layer, z, r)
        seconds.append(time.perf_counter() - t)
        want = moe_experts_grouped(z, r.topk_idx, r.topk_weight, dense, layer.expert_act)
        error = max(error, float((y - want).abs().max()))
        imbalance.append(backend.drain_stats()[0].rank_max_over_mean)
    return {"error": error, "imbalance": imbalance, "seconds": seconds, "history": [tuple(h) for h in backend.rebalance.history]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank and call")
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--interval", type=int, default=10)
    args = p.parse_args()
    results = run_ranks(work, args.world, args.experts, args.tokens, args.calls, args.interval)
    error = max(float(r["error"]) for r in results)  # type: ignore[arg-type]
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    flags = f"--world {args.world} --experts {args.experts} --tokens {args.tokens} --calls {args.calls} --interval {args.interval}"
    print(f"command: python benchmarks/eplb_live.py {flags}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; commit {commit}\n")
    if error > 1e-5:
        raise SystemExit(f"refused: the outputs differ from one process's by {error:.2e} (> 1e-5)")
    r0 = results[0]
    imbalance, seconds, history = r0["imbalance"], r0["seconds"], r0["history"]
    assert isinstance(imbalance, list) and isinstance(seconds, list) and isinstance(history, list)
    replaced_at = {h[1]: h for h in history}
    plain = sorted(s for i, s in enumerate(seconds) if i not in replaced_at)[len(seconds) // 2 - 1] * 1e3
    print(f"outputs = one process's at every call (max |diff| {error:.1e}); a plain call takes {plain:.1f} ms (median, rank 0)\n")
    print("| calls | hot expert | served by the placement from | measured rank max/mean (mean of calls) | re-placement at the first call |")
    print("|---|---:|---|---:|---|")
    for start in range(0, args.calls, args.interval):
        stop = min(args.calls, start + args.interval)
        hot = 2 if start < args.calls // 2 else args.experts - 1
        source = "an even start" if start == 0 else f"calls {start - args.interval}-{start - 1}"
        mean = sum(imbalance[start:stop]) / (stop - start)
        h = replaced_at.get(start)
        move = f"{h[2]:.2f} -> {h[3]:.2f}, {h[4]} moved, {seconds[start] * 1e3:.1f} ms" if h else "-"
        print(f"| {start}-{stop - 1} | {hot} | {source} | {mean:.2f} | {move} |")


if __name__ == "__main__":
    main()
