"""The served one-call layers against the layers' own forwards, in one process: decode steps of the demo model, alternating.

    python benchmarks/served_layers.py [--batches 1,16] [--rounds 25] [--steps 4] [--layers all,moe,kda,mla]

On CPU with packed weights the serving layout turns every latent MoE layer into a ServedLatentMoE (serve/fused_moe.py),
every KDA layer into a ServedKDA (serve/fused_kda.py) and every MLA layer into a ServedMLA (serve/fused_mla.py), whose
decode steps run one C call each where the layer's own forward runs ~10 (the MLA layer: for its inputs). Here one engine decodes a
batch of greedy requests while the layers' classes are switched every `--steps` steps between the served ones ("one call")
and the model's own (LatentMoE, KimiDeltaAttention, GatedMLA: "own forward"), order alternating per round, one untimed step after each
switch; times are this process's CPU time at one thread (`time.process_time`: what the other processes of a shared machine
take is left out). Per-round ratio = own / one call. The greedy tokens of both arms are the same by construction (one
sequence of steps); the one-call paths' exactness is tested bit for bit in tests/serve/test_fused_moe.py and
tests/serve/test_fused_kda.py (all three), and benchmarks/roofline.py prints a token digest per run.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch


def arm(engine: Any, layers: Sequence[torch.nn.Module], classes: dict[int, type], steps: int) -> float:
    """CPU seconds per decode step with each layer's class set from `classes` (one untimed step after the switch)."""
    for m in layers:
        m.__class__ = classes[id(m)]
    engine.step()
    t = time.process_time()
    for _ in range(steps):
        engine.step()
    return (time.process_time() - t) / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per arm and round")
    ap.add_argument("--layers", default="all,moe,kda,mla", help="which layers switch: all, moe, kda or mla (that kind only)")
    ap.add_argument("--prompt", type=int, default=64)
    args = ap.parse_args()
    from openk3 import LLM
    from openk3.model.kda import KimiDeltaAttention
    from openk3.model.mla import GatedMLA
    from openk3.model.moe import LatentMoE
    from openk3.serve.cpu_heap import keep_heap_for_reuse
    from openk3.serve.sampling import SamplingParams

    keep_heap_for_reuse()
    torch.set_num_threads(1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    print(f"command: {' '.join(['python', *sys.argv])}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs; torch {torch.__version__}; commit {commit}; 1 thread; clock: process")
    print(f"load average before: {os.getloadavg()[0]:.1f}\n")
    print("| batch | layers switched | own forward ms (median) | one call ms (median) | per-round ratio median (min..max) |")
    print("|---:|---|---:|---:|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        llm = LLM("tiny", max_num_seqs=batch)
        engine = llm.engine
        model = engine.runner.model
        kinds_of = {"moe": LatentMoE, "kda": KimiDeltaAttention, "mla": GatedMLA}
        layers = [m for m in model.modules() if isinstance(m, LatentMoE | KimiDeltaAttention | GatedMLA)]
        served: dict[int, type] = {id(m): type(m) for m in layers}
        own: dict[int, type] = {id(m): next(k for k in kinds_of.values() if isinstance(m, k)) for m in layers}
        if served == own:
            raise SystemExit("the engine's layers are not the served ones (no C kernels, or pack_cpu_weights off): nothing to compare")
        gen = torch.Generator().manual_seed(1)
        params = SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"r{i}", torch.randint(3, model.config.vocab_size, (args.prompt,), generator=gen).tolist(), params)
        for _ in range(6):
            engine.step()

        for which in args.layers.split(","):
            kinds = tuple(kinds_of.values()) if which == "all" else (kinds_of[which],)
            one = {k: (v if own[k] in kinds else own[k]) for k, v in served.items()}
            a, b = [], []
            for r in range(args.rounds):
                if r % 2:
                    a.append(arm(engine, layers, own, args.steps))
                    b.append(arm(engine, layers, one, args.steps))
                else:
                    b.append(arm(engine, layers, one, args.steps))
                    a.append(arm(engine, layers, own, args.steps))
            ratios = [x / y for x, y in zip(a, b, strict=True)]
            print(
                f"| {batch} | {which} | {statistics.median(a) * 1e3:.2f} | {statistics.median(b) * 1e3:.2f} |"
                f" {statistics.median(ratios):.3f}x ({min(ratios):.2f}..{max(ratios):.2f}) |"
            )
        for m in layers:
            m.__class__ = served[id(m)]
        llm.close()
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
