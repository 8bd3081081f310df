"""Collectives per decode step and decode step time of `LLM(..., ep=N)`, for two source trees in one run: the tree this
script lives in ("new") against another checkout ("old", e.g. `git archive HEAD | tar -x -C /tmp/oldep`).

Each (tree, method) runs in a child process with PYTHONPATH set to that tree. The child counts the torch.distributed
calls of rank 0 (this process drives the engine; every rank issues the same MoE collectives), by wrapping the
torch.distributed functions. Per decode step = (a generate of 1 + n tokens minus a generate of 1 token) / n, so prefill
and start-up cancel; a child's time is the median of --reps such differences, the table's the median over --rounds
children, old and new alternating. Tokens of every run are checked against one process
(the new tree); a mismatch is reported instead of figures. eplb places from the expert load that one-process run
exported (export_eplb_stats); a tree without the eplb_stats setting places from a uniform load, as it did. A second
table times one MoE layer alone (the model's shape, plain EP, 2 spawned ranks, --layer-tokens per rank): old exchange,
new exact exchange, new fixed-capacity exchange.

  python benchmarks/ep_exchange.py --old /tmp/oldep                       # tiny, ep=2, ep/eplb/moonep, 16 decode steps
  python benchmarks/ep_exchange.py --old /tmp/oldep --methods ep --tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
PROMPT = "And God said, Let there be light"
COUNTED = ("all_to_all_single", "all_gather", "all_gather_into_tensor", "all_reduce", "broadcast", "barrier")


def load_file_settings(ep: int, method: str, stats: str | None) -> dict[str, str]:
    """export_eplb_stats for the one-process run, eplb_stats for eplb: what this child's tree has of the two."""
    import dataclasses

    from openk3.parallel.config import ParallelConfig

    known = {f.name for f in dataclasses.fields(ParallelConfig)}
    if stats is not None and ep == 1 and "export_eplb_stats" in known:
        return {"export_eplb_stats": stats}
    if stats is not None and method == "eplb" and "eplb_stats" in known:
        return {"eplb_stats": stats}
    return {}


def child(model: str, ep: int, method: str, tokens: int, reps: int, threads: int, stats: str | None) -> dict[str, Any]:
    import warnings

    import torch
    import torch.distributed as dist

    from openk3.llm import LLM
    from openk3.serve.sampling import SamplingParams

    torch.set_num_threads(threads)
    warnings.simplefilter("ignore")
    calls: dict[str, int] = dict.fromkeys(COUNTED, 0)
    for name in COUNTED:
        original = getattr(dist, name)

        def counted(*args: Any, _name: str = name, _fn: Callable[..., Any] = original, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _fn(*args, **kwargs)

        setattr(dist, name, counted)
    placed = load_file_settings(ep, method, stats)
    llm = LLM(model, **placed) if ep == 1 else LLM(model, ep=ep, ep_method=method, ep_threads=threads, **placed)
    try:

        def run(n: int) -> tuple[list[int], float, dict[str, int]]:
            before = dict(calls)
            start = time.perf_counter()
            out = llm.generate([PROMPT], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            wall = time.perf_counter() - start
            return list(out[0].outputs[0].token_ids), wall, {k: calls[k] - before[k] for k in COUNTED}

        run(2)  # warm-up
        step_s, per_step = [], {}
        for _ in range(reps):
            _, short_s, short_calls = run(1)
            got, long_s, long_calls = run(1 + tokens)
            step_s.append((long_s - short_s) / tokens)
            per_step = {k: (long_calls[k] - short_calls[k]) / tokens for k in COUNTED}
    finally:
        llm.close()
    import openk3

    return {"tokens": got, "step_s": statistics.median(step_s), "per_step": per_step, "source": openk3.__file__}


def layer_rank(ctx: Any, tokens: int, calls: int, padded: bool) -> dict[str, Any]:
    """One rank of the layer benchmark: `calls` MoE calls of the model's first MoE layer, plain EP, stats off."""
    import torch
    import torch.distributed as dist

    from openk3.config import tiny
    from openk3.model.moe import LatentMoE
    from openk3.parallel.ep.static_backend import ExpertParallelBackend

    torch.set_grad_enabled(False)
    cfg = tiny()
    layer = LatentMoE(cfg, layer_index=1).eval()
    g = torch.Generator().manual_seed(0)
    for p in layer.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    bank = layer.experts.bank()
    if padded:  # the old tree has no fixed-capacity exchange: imported only for the new one
        from openk3.parallel.ep.padded import Capacity

        capacity = Capacity(float(cfg.moe.num_experts), tokens)  # C = tokens: nothing drops
        backend = ExpertParallelBackend.from_banks(ctx, {1: bank}, collect_stats=False, capacity=capacity)
    else:
        backend = ExpertParallelBackend.from_banks(ctx, {1: bank}, collect_stats=False)
    z = torch.randn(tokens, cfg.moe.latent_size or cfg.hidden_size, generator=torch.Generator().manual_seed(1 + ctx.rank))
    scores = torch.rand(tokens, cfg.moe.num_experts, generator=torch.Generator().manual_seed(2 + ctx.rank))
    from openk3.ops.moe.router import RouterOutput

    idx = torch.topk(scores, cfg.moe.num_experts_per_token, dim=1).indices
    routing = RouterOutput(idx, torch.rand(idx.shape, generator=g) + 0.1, scores)
    first = backend(layer, z, routing)
    issued = [0]
    original = dist.all_to_all_single

    def counted(*a: Any, **kw: Any) -> Any:
        issued[0] += 1
        return original(*a, **kw)

    dist.all_to_all_single = counted
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        backend(layer, z, routing)
    wall = time.perf_counter() - start
    dist.all_to_all_single = original
    return {"call_s": wall / calls, "a2a_per_call": issued[0] / calls, "digest": float(first.double().sum())}


def layer_child(tokens: int, calls: int, padded: bool) -> dict[str, Any]:
    from openk3.parallel.launch import run_ranks

    per_rank = run_ranks(layer_rank, 2, tokens, calls, padded)
    import openk3

    return {
        "call_s": max(r["call_s"] for r in per_rank),
        "a2a_per_call": per_rank[0]["a2a_per_call"],
        "digest": [r["digest"] for r in per_rank],
        "source": openk3.__file__,
    }


def run_child(tree: Path, args: argparse.Namespace, method: str, ep: int, stats: Path | None = None) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", method, "--ep", str(ep), "--model", args.model]
    cmd += ["--stats", str(stats)] if stats is not None else []
    cmd += ["--tokens", str(args.tokens), "--reps", str(args.reps), "--threads", str(args.threads)]
    cmd += ["--layer-tokens", str(args.layer_tokens), "--layer-calls", str(args.layer_calls)]
    done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"child {method} in {tree} failed:\n{done.stderr[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(out["source"]).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"child {method} imported openk3 from {out['source']}, not from {tree}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=False, help="the other source tree (its openk3/ is imported)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--methods", nargs="+", default=["ep", "eplb", "moonep"], choices=["ep", "eplb", "moonep"])
    parser.add_argument("--tokens", type=int, default=16, help="decode steps measured per repetition")
    parser.add_argument("--reps", type=int, default=3, help="repetitions inside one child (median)")
    parser.add_argument("--rounds", type=int, default=3, help="children per (tree, method), old and new alternating (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    parser.add_argument("--parts", nargs="+", default=["engine", "layer"], choices=["engine", "layer"])
    parser.add_argument("--layer-tokens", type=int, default=4, help="tokens per rank in the layer benchmark (decode-sized)")
    parser.add_argument("--layer-calls", type=int, default=200, help="MoE calls timed per layer-benchmark child")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--stats", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        if args.child.startswith("layer"):
            print(json.dumps(layer_child(args.layer_tokens, args.layer_calls, args.child == "layer_padded")))
        else:
            print(json.dumps(child(args.model, args.ep, args.child, args.tokens, args.reps, args.threads, args.stats)))
        return 0
    if args.old is None:
        parser.error("--old TREE is required (e.g. git archive HEAD | tar -x -C /tmp/oldep)")

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "openk3/parallel/ep"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    print("command: python " + " ".join(sys.argv))
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {args.threads} thread(s) per process")
    print(f"new: {HERE} (commit {commit}{' + uncommitted ep/ changes' if dirty else ''}); old: {args.old}")
    print(f"model {args.model}, ep={args.ep}, 1 prompt, {args.tokens} decode steps x {args.reps} repetitions x {args.rounds} rounds (medians)\n")

    if "engine" in args.parts:
        engine_table(args)
    if "layer" in args.parts:
        layer_table(args)
    return 0


def engine_table(args: argparse.Namespace) -> None:
    stats = Path(tempfile.mkdtemp(prefix="openk3-ep-exchange-")) / "load.json"
    want = run_child(HERE, args, "ep", 1, stats)["tokens"]  # also exports the load eplb places from
    trees = (("old", args.old), ("new", HERE))
    # Rounds alternate old and new, so a change in the machine's load hits both alike.
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {(m, name): [] for m in args.methods for name, _ in trees}
    for _ in range(args.rounds):
        for method in args.methods:
            for name, tree in trees:
                runs[method, name].append(run_child(tree, args, method, args.ep, stats))
    print(f"| {'method':<7} | tree | a2a | all_gather | broadcast | all collectives | step ms | new/old time | check |")
    print("|---------|------|-----|------------|-----------|-----------------|---------|--------------|-------|")
    for method in args.methods:
        ok = {name: all(r["tokens"] == want for r in runs[method, name]) for name, _ in trees}
        step = {name: statistics.median(r["step_s"] for r in runs[method, name]) for name, _ in trees}
        for name, _ in trees:
            per = runs[method, name][-1]["per_step"]
            gathers = per["all_gather"] + per["all_gather_into_tensor"]
            ratio = f"{step['new'] / step['old']:.2f}" if name == "new" and ok["new"] and ok["old"] else ""
            ms = f"{step[name] * 1e3:.1f}" if ok[name] else "-"
            check = "tokens equal" if ok[name] else "MISMATCH"
            cells = [method, name, f"{per['all_to_all_single']:.0f}", f"{gathers:.0f}", f"{per['broadcast']:.0f}", f"{sum(per.values()):.0f}", ms, ratio, check]
            print("| " + " | ".join(cells) + " |")


def layer_table(args: argparse.Namespace) -> None:
    """One MoE layer of the model (plain EP, 2 ranks), timed alone: the exchange without the trunk around it."""
    variants = (("old", args.old, "layer"), ("new", HERE, "layer"), ("new, fixed capacity", HERE, "layer_padded"))
    layer_runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in variants}
    for _ in range(args.rounds):
        for name, tree, kind in variants:
            layer_runs[name].append(run_child(tree, args, kind, args.ep))
    print(f"\none MoE layer, plain EP, 2 ranks, {args.layer_tokens} tokens per rank, {args.layer_calls} calls x {args.rounds} rounds (median)\n")
    print("| exchange | all_to_all per call | ms per call | vs old | output |")
    print("|---|---|---|---|---|")
    base = statistics.median(r["call_s"] for r in layer_runs["old"])
    want_digest = layer_runs["old"][0]["digest"]
    for name, _, _ in variants:
        runs_here = layer_runs[name]
        same = all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for r in runs_here for a, b in zip(r["digest"], want_digest, strict=True))
        call_s = statistics.median(r["call_s"] for r in runs_here)
        cells = [name, f"{runs_here[-1]['a2a_per_call']:.0f}", f"{call_s * 1e3:.2f}" if same else "-", f"{call_s / base:.2f}" if same else "-"]
        print("| " + " | ".join([*cells, "equal to old" if same else "MISMATCH"]) + " |")


if __name__ == "__main__":
    raise SystemExit(main())
