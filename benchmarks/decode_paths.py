"""Issue 42's fifth turn's decode paths against the ones they replace, in one process: decode steps of the demo model, alternating.

    python benchmarks/decode_paths.py [--batches 1,16,64] [--rounds 30] [--steps 4] [--paths all,argmax,reads,router]

One engine decodes a batch of greedy requests while each path is switched every `--steps` steps between this turn's form
("new") and the one it replaces ("old"), order alternating per round, one untimed step after each switch; times are this
process's CPU time at one thread (`time.process_time`). Per-round ratio = old / new. The paths:
- argmax: the sampler's greedy argmax, the registry's "argmax_rows" "fast" (ops/argmax_c.py) against torch.argmax ("naive");
- reads: the AttnRes stream's reads with the sources' addresses kept in the stream (ops/attn_res/mix_c.py OneShotStreamC)
  against a read through attn_res_c each time (the previous OneShotStreamC.read, defined here);
- router: the MoE layers' router top-k inside the one C call ("moe_routed_latent_block") against the router called first
  (a `route` set on each layer, which makes the served layer call it, as it did before);
- all: the three together.
Every path gives the same bits either way (tests/ops/test_argmax_c.py, test_attn_res_c.py, test_moe_block_c.py,
tests/serve/test_fused_moe.py), so both arms continue one sequence of greedy tokens.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch


def previous_reads() -> Callable[[torch.Tensor], Any]:
    """The "sized" stream with the previous reads: attn_res_c over the source list at every read."""
    from openk3.ops.attn_res.mix_c import attn_res_c
    from openk3.ops.attn_res.naive import OneShotStream
    from openk3.ops.attn_res.stream import MixQuery
    from openk3.ops.attn_res.two_phase import TwoPhaseStream
    from openk3.ops.thresholds import TWO_PHASE_MIN_TOKENS

    class ReadThroughAttnResC(OneShotStream):
        def read(self, mixer: MixQuery | None) -> torch.Tensor:
            sources = self._blocks if self._partial is None else [*self._blocks, self._partial]
            if len(sources) == 1:
                return sources[0]
            assert mixer is not None
            return attn_res_c(sources, mixer.query_D, mixer.norm_weight_D, mixer.eps)

    return lambda embed: TwoPhaseStream(embed) if embed.shape[0] >= TWO_PHASE_MIN_TOKENS else ReadThroughAttnResC(embed)


def switches(engine: Any) -> dict[str, Callable[[bool], None]]:
    """path -> set(new): puts the path's new (True) or old (False) form in place."""
    from openk3.ops.registry import registry
    from openk3.serve.fused_moe import ServedLatentMoE

    model, sampler = engine.runner.model, engine.runner.sampler
    argmax = {True: registry().get("argmax_rows", "fast"), False: registry().get("argmax_rows", "naive")}
    streams = {True: model.model.depth_stream, False: previous_reads()}
    moes = [m for m in model.modules() if isinstance(m, ServedLatentMoE)]
    if not moes:
        raise SystemExit("the engine's MoE layers are not the served ones (no C kernels, or pack_cpu_weights off): nothing to compare")

    def set_argmax(new: bool) -> None:
        sampler.argmax = argmax[new]

    def set_reads(new: bool) -> None:
        model.model.depth_stream = streams[new]

    def set_router(new: bool) -> None:
        for m in moes:
            if new:
                m.__dict__.pop("route", None)
            else:
                m.route = m.route  # type: ignore[method-assign]

    def set_all(new: bool) -> None:
        for f in (set_argmax, set_reads, set_router):
            f(new)

    return {"argmax": set_argmax, "reads": set_reads, "router": set_router, "all": set_all}


def arm(engine: Any, switch: Callable[[bool], None], new: bool, steps: int) -> float:
    switch(new)
    engine.step()
    t = time.process_time()
    for _ in range(steps):
        engine.step()
    return (time.process_time() - t) / steps


def compare(engine: Any, switch: Callable[[bool], None], rounds: int, steps: int) -> tuple[list[float], list[float]]:
    old: list[float] = []
    new: list[float] = []
    for r in range(rounds):
        order: Sequence[bool] = (False, True) if r % 2 else (True, False)
        for which in order:
            (new if which else old).append(arm(engine, switch, which, steps))
    return old, new


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per arm and round")
    ap.add_argument("--paths", default="all,argmax,reads,router")
    ap.add_argument("--prompt", type=int, default=64)
    args = ap.parse_args()
    from openk3 import LLM
    from openk3.serve.cpu_heap import keep_heap_for_reuse
    from openk3.serve.sampling import SamplingParams

    keep_heap_for_reuse()
    torch.set_num_threads(1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    print(f"command: {' '.join(['python', *sys.argv])}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs; torch {torch.__version__}; commit {commit}; 1 thread; clock: process")
    print(f"load average before: {os.getloadavg()[0]:.1f}\n")
    print("| batch | path | old ms (median) | new ms (median) | per-round ratio old / new, median (min..max) |")
    print("|---:|---|---:|---:|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        llm = LLM("tiny", max_num_seqs=batch)
        engine = llm.engine
        vocab = engine.runner.model.config.vocab_size
        gen = torch.Generator().manual_seed(1)
        params = SamplingParams(temperature=0, max_tokens=10**6, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"r{i}", torch.randint(3, vocab, (args.prompt,), generator=gen).tolist(), params)
        for _ in range(6):
            engine.step()
        paths = switches(engine)
        for path in args.paths.split(","):
            old, new = compare(engine, paths[path], args.rounds, args.steps)
            paths["all"](True)
            ratios = [a / b for a, b in zip(old, new, strict=True)]
            print(
                f"| {batch} | {path} | {statistics.median(old) * 1e3:.2f} | {statistics.median(new) * 1e3:.2f} |"
                f" {statistics.median(ratios):.3f}x ({min(ratios):.2f}..{max(ratios):.2f}) |"
            )
        llm.close()
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
