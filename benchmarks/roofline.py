"""A decode step's time against the memory roofline: the bytes the step must read over this machine's read bandwidth.

    python benchmarks/roofline.py [--threads 1,2] [--batches 1,16,64] [--steps 10] [--k3-layers 2 --k3-experts 32 --k3-batches 1,16]

1. Bandwidth: a STREAM-style read (sum of a 512 MiB fp32 array) and copy (into a second one, read + write bytes counted),
   at the engine's thread count; the best of several runs. The roofline uses the read figure.
2. Bytes a decode step of B sequences at context L must move, counted from the model the engine runs:
   - weights: every parameter except the embedding (B rows of it are read) and the routed experts; the LM head is included;
   - routed experts: the distinct experts the step's routing picked, per MoE layer (each layer's inputs recorded during
     the timed steps, routed again after them), times one expert's resident bytes (packed MXFP4 where the model keeps them so);
   - MLA: the latent pages of the context, each token's cached latent (kv_lora_rank + rope dims) per MLA layer;
   - KDA: each sequence's recurrent state and conv window per KDA layer, read and written back (2x).
   Activations are left out (a few hundred KiB at these widths).
3. Time: `engine.step()` (the whole step: scheduler, batch building, forward, sampling, output) and the model forward inside it,
   over `--steps` pure decode steps after the prompts are in; min and median. Ratio = measured / roofline. `--clock process`
   times the bandwidth runs and the steps in this process's CPU time instead of wall time: at 1 thread that is the time the
   process ran, which leaves out the time other processes on a shared machine took the core (at 2 threads it adds the
   threads' times, spinning included, so use it at 1 thread).

Models: the demo model (LLM("tiny")), and a K3-shaped slice: K3's widths (hidden 7168, 96 KDA and MLA heads, latent MoE of
width 3584 with 3072-wide experts, top-16, two shared experts) with `--k3-layers` layers (one in four MLA, the last MLA),
`--k3-experts` routed experts (896 in K3; kept small to fit memory) and a 4096-token vocabulary, random weights.
Greedy tokens of every run are printed as a digest, so that a change to the engine can be checked for identical tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

MIB = 1 << 20
CLOCKS = {"wall": time.perf_counter, "process": time.process_time}


def read_bandwidth(clock: Callable[[], float], repeats: int = 7, mib: int = 512) -> tuple[float, float]:
    """(read, copy) bytes per second with torch's current threads: sum over an array, copy into another (both counted)."""
    a = torch.ones(mib * MIB // 4)
    b = torch.empty_like(a)
    read, copy = [], []
    for _ in range(repeats):
        t = clock()
        a.sum()
        read.append(clock() - t)
        t = clock()
        b.copy_(a)
        copy.append(clock() - t)
    return a.nbytes / min(read), 2 * a.nbytes / min(copy)


def fma_rate(clock: Callable[[], float], repeats: int = 5, n: int = 1024) -> float:
    """Fused multiply-adds per second of torch's fp32 GEMM (n x n times n x n, in cache) with torch's current threads: the
    compute ceiling the step's products are held to (the C row kernels measured no faster at 16 rows)."""
    a = torch.randn(n, n)
    a @ a
    best = min(_timed(clock, lambda: a @ a) for _ in range(repeats))
    return n**3 / best


def _timed(clock: Callable[[], float], fn: Callable[[], Any]) -> float:
    t = clock()
    fn()
    return clock() - t


def step_fmas(model: torch.nn.Module, batch: int) -> int:
    """Multiply-adds a decode step of `batch` tokens does in its products: every weight but the embedding once per token
    (the LM head included), and each token's top-k routed experts per MoE layer (attention and KDA state arithmetic left
    out: under 1% at these contexts)."""
    from openk3.model.moe import DenseExperts, LatentMoE, PackedExperts

    skip = {id(t) for m in model.modules() if isinstance(m, DenseExperts | PackedExperts) for t in [*m.parameters(), *m.buffers()]}
    embed = model.model.embed_tokens.weight  # type: ignore[union-attr]
    if model.lm_head.weight is not embed:  # type: ignore[union-attr]
        skip.add(id(embed))
    dense = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    experts = 0
    for layer in (m for m in model.modules() if isinstance(m, LatentMoE)):
        bank = layer.experts
        e = layer.gate.weight.shape[0]
        per_expert = sum(t.numel() * (2 if t.dtype == torch.uint8 and n.endswith("_packed") else 0) for n, t in bank.named_buffers())
        per_expert += sum(p.numel() for p in bank.parameters())
        experts += layer.top_k * per_expert // e
    return batch * (dense + experts)


class RoutingCount:
    """Records each MoE layer's input during the timed steps (a forward pre-hook on the layer: one call per layer per step),
    and routes them again afterwards to count the distinct experts of every call. Not a wrapper around `route`: a served
    layer runs its router inside its one C call only when nothing wraps it (serve/fused_moe.py)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from openk3.model.moe import LatentMoE

        self.layers = [m for m in model.modules() if isinstance(m, LatentMoE)]
        self.inputs: list[tuple[Any, torch.Tensor]] = []
        self.on = False
        for layer in self.layers:
            layer.register_forward_pre_hook(self._record)

    def _record(self, layer: Any, args: tuple[Any, ...]) -> None:
        if self.on:
            self.inputs.append((layer, args[0]))

    def distinct(self) -> list[int]:
        """The distinct experts of each recorded call (the inputs are then released)."""
        with torch.no_grad():
            counts = [int(layer.route(x).topk_idx.unique().numel()) for layer, x in self.inputs]
        self.inputs.clear()
        return counts

    def expert_bytes(self) -> int:
        """Resident bytes of one routed expert (all layers alike)."""
        experts = self.layers[0].experts
        total = sum(t.nbytes for t in [*experts.parameters(), *experts.buffers()])
        return total // self.layers[0].gate.weight.shape[0]


def weight_bytes(model: torch.nn.Module, batch: int) -> int:
    """Parameters read by a decode step apart from the routed experts: all of them, but only `batch` rows of the embedding."""
    from openk3.model.moe import DenseExperts, PackedExperts

    skip = {id(t) for m in model.modules() if isinstance(m, DenseExperts | PackedExperts) for t in [*m.parameters(), *m.buffers()]}
    embed = model.model.embed_tokens.weight  # type: ignore[union-attr]
    if model.lm_head.weight is embed:  # type: ignore[union-attr]  # tied: the LM head reads all of it
        embed = None
    total = 0
    for p in model.parameters():
        if id(p) in skip:
            continue
        total += batch * p.shape[1] * p.element_size() if p is embed else p.nbytes
    return total


def cache_bytes(cache: Any, batch: int, context: int) -> tuple[int, int]:
    """(MLA latent bytes read, KDA state + conv bytes read and written) for `batch` sequences at `context` tokens."""
    mla = sum(context * t.shape[-1] * t.element_size() for t in cache.mla_latent) * batch
    kda = sum(t[0].nbytes for t in cache.kda_state) + sum(t[0].nbytes for t in cache.conv_state)
    return mla, 2 * kda * batch


def k3_slice(layers: int, experts: int) -> Any:
    from openk3.config import k3
    from openk3.config.presets import k3_schedule

    base = k3()
    return dataclasses.replace(
        base,
        name="k3_slice",
        vocab_size=4096,
        num_hidden_layers=layers,
        mla_layers=k3_schedule(layers),
        moe=dataclasses.replace(base.moe, num_experts=experts),
        first_k_dense_replace=0,
        attn_res_block_size=min(base.attn_res_block_size, layers),
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def run(llm: Any, batch: int, prompt: int, steps: int, warm: int, seed: int, tag: str, clock: Callable[[], float]) -> dict[str, Any]:
    from openk3.serve.sampling import SamplingParams

    engine = llm.engine
    runner = engine.runner
    counter = RoutingCount(runner.model) if not hasattr(runner, "_roofline_count") else runner._roofline_count
    runner._roofline_count = counter
    forward = runner._forward
    fwd_times: list[float] = []

    def timed(batch_: Any) -> Any:
        if not counter.on:  # only the timed steps: the prompts and the drain after them run smaller batches
            return forward(batch_)
        t = clock()
        out = forward(batch_)
        fwd_times.append(clock() - t)
        return out

    runner._forward = timed
    vocab = runner.model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    ids = [f"{tag}-{i}" for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=warm + steps + 2, ignore_eos=True)
    for rid in ids:
        engine.add_request(rid, torch.randint(3, vocab, (prompt,), generator=gen).tolist(), params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}

    def step() -> None:
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)

    while any(not t for t in tokens.values()):  # the prompts, in as many steps as the scheduler takes
        step()
    for _ in range(warm):
        step()
    step_times: list[float] = []
    fwd_times.clear()
    counter.inputs.clear()
    counter.on = True
    for _ in range(steps):
        t = clock()
        step()
        step_times.append(clock() - t)
    counter.on = False
    while engine.has_unfinished():
        step()
    runner._forward = forward
    mla, kda = cache_bytes(runner.cache.tensors, batch, prompt + warm + steps // 2)
    experts = statistics.mean(counter.distinct()) * len(counter.layers) if counter.layers else 0.0
    digest = hashlib.sha256(str([tokens[r] for r in ids]).encode()).hexdigest()[:12]
    return {
        "step": step_times,
        "forward": fwd_times,
        "weights": weight_bytes(runner.model, batch),
        "experts": experts * counter.expert_bytes() if counter.layers else 0.0,
        "distinct": experts / max(1, len(counter.layers)),
        "mla": mla,
        "kda": kda,
        "fmas": step_fmas(runner.model, batch),
        "tokens": digest,
    }


def set_arm(llm: Any, arm: str) -> None:
    """Every MoE layer's expert path: "engine" as chosen for the engine's target, "before" (issue 42's starting point:
    the torch MXFP4 decode and the per-expert grouped loop for packed banks), or "decoded" (the engine's path before the
    fused MXFP4 products: the C decode of every picked expert into fp32, then the dense C expert loop; one token: each
    expert decoded in C, then its products)."""
    import functools

    from openk3.model.moe import LocalExperts
    from openk3.ops.linear import linear_c
    from openk3.ops.moe import moe_experts_sized
    from openk3.ops.moe.cpu_pairs import moe_experts_batched_c
    from openk3.ops.mxfp4 import dequantize
    from openk3.ops.mxfp4_c import dequantize_c

    for layer in _moe_layers(llm):
        backend = layer.backend
        if isinstance(backend, LocalExperts):
            if not hasattr(backend, "_chosen"):
                backend._chosen = (backend.decode, backend.op)
            if arm == "before":
                backend.decode, backend.op = dequantize, functools.partial(moe_experts_sized, linear=linear_c, batched_c=None)
            elif arm == "decoded":
                backend.decode, backend.op = dequantize_c, functools.partial(moe_experts_sized, linear=linear_c, batched_c=moe_experts_batched_c)
            else:
                backend.decode, backend.op = backend._chosen


def _moe_layers(llm: Any) -> list[Any]:
    from openk3.model.moe import LatentMoE

    return [m for m in llm.engine.runner.model.modules() if isinstance(m, LatentMoE)]


def report(name: str, llm: Any, batches: list[int], args: argparse.Namespace, read_bw: dict[int, float], fma: dict[int, float]) -> None:
    threads = list(read_bw)
    decodes = ["engine", *(["decoded"] if args.compare_decoded else []), *(["before"] if args.compare_before else [])]
    arms = [(t, d) for t in threads for d in decodes]
    print(f"\n{name}: prompt {args.prompt} tokens, {args.warm} warm-up then {args.steps} timed decode steps per run")
    print(f"interleaved: for each batch, {args.rounds} rounds of one run per arm (threads, MoE expert path); min and median over a row's timed steps\n")
    print(
        "| batch | threads | MoE experts | weights MiB | experts MiB (distinct/layer) | MLA MiB | KDA MiB | roofline ms | step ms min / med"
        " | forward ms min / med | step / roofline (min) | forward / roofline (min) | compute ms | step / max(roofline, compute) | tokens |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for i, b in enumerate(batches):
        rows: dict[tuple[int, str], list[dict[str, Any]]] = {a: [] for a in arms}
        for _ in range(args.rounds):
            for t, d in arms:
                torch.set_num_threads(t)
                set_arm(llm, d)
                tag = f"b{b}-t{t}-{d}-r{len(rows[(t, d)])}"
                rows[(t, d)].append(run(llm, b, args.prompt, args.steps, args.warm, seed=i, tag=tag, clock=CLOCKS[args.clock]))  # same seed: same prompts
        set_arm(llm, "engine")
        for t, d in arms:
            r = rows[(t, d)][0]
            steps = [x for run_ in rows[(t, d)] for x in run_["step"]]
            fwds = [x for run_ in rows[(t, d)] for x in run_["forward"]]
            total = r["weights"] + r["experts"] + r["mla"] + r["kda"]
            roof = total / read_bw[t]
            compute = r["fmas"] / fma[t]
            digests = sorted({run_["tokens"] for run_ in rows[(t, d)]})
            print(
                f"| {b} | {t} | {d} | {r['weights'] / MIB:.1f} | {r['experts'] / MIB:.1f} ({r['distinct']:.1f}) | {r['mla'] / MIB:.2f} | {r['kda'] / MIB:.2f}"
                f" | {roof * 1e3:.2f} | {min(steps) * 1e3:.1f} / {statistics.median(steps) * 1e3:.1f} | {min(fwds) * 1e3:.1f} /"
                f" {statistics.median(fwds) * 1e3:.1f} | {min(steps) / roof:.1f}x | {min(fwds) / roof:.1f}x | {compute * 1e3:.2f}"
                f" | {min(steps) / max(roof, compute):.1f}x | {' '.join(digests)} |"
            )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2", help="torch thread counts, measured interleaved")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--k3-layers", type=int, default=2, help="layers of the K3-shaped slice (0: skip it)")
    ap.add_argument("--k3-experts", type=int, default=32)
    ap.add_argument("--k3-batches", default="1,16", help="batch sizes of the slice (its steps take seconds)")
    ap.add_argument("--k3-steps", type=int, default=3)
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument(
        "--compare-before", action="store_true", help="also run every arm with the MoE expert path before issue 42 (torch MXFP4 decode, per-expert loop)"
    )
    ap.add_argument(
        "--compare-decoded", action="store_true", help="also run every arm with the picked experts decoded to fp32 before their products (before fused MXFP4)"
    )
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="what times the bandwidth runs and the steps: wall, or this process's CPU time (at 1 thread the time it ran, what others' load leaves out)",
    )
    ap.add_argument("--system-heap", action="store_true", help="leave glibc's heap settings (default: keep_heap_for_reuse, as openk3 serve)")
    ap.add_argument("--ops", default=None, help="EngineConfig.ops for both models, e.g. kda=in_pool")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    from openk3 import LLM
    from openk3.serve.cpu_heap import keep_heap_for_reuse

    heap = "system" if args.system_heap else f"keep (applied: {keep_heap_for_reuse()})"

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    print(f"command: {' '.join(['python', *sys.argv])}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs; torch {torch.__version__}; commit {commit}")
    print(f"load average before: {os.getloadavg()[0]:.1f}; C heap: {heap}; clock: {args.clock}")
    read_bw, fma = {}, {}
    for t in threads:
        torch.set_num_threads(t)
        read_bw[t], copy_bw = read_bandwidth(CLOCKS[args.clock])
        fma[t] = fma_rate(CLOCKS[args.clock])
        print(
            f"bandwidth at {t} threads: read {read_bw[t] / 1e9:.1f} GB/s, copy {copy_bw / 1e9:.1f} GB/s (read + write bytes); roofline = bytes / read;"
            f" fp32 GEMM {fma[t] / 1e9:.1f} G multiply-adds/s; compute = the step's multiply-adds / that"
        )
    batches = [int(b) for b in args.batches.split(",")]
    extra = {} if args.ops is None else {"ops": args.ops}
    if not args.skip_tiny:
        tiny = LLM("tiny", max_num_seqs=max(batches), **extra)
        report("tiny (demo model)", tiny, batches, args, read_bw, fma)
        tiny.close()
    if args.k3_layers:
        model = k3_slice_model(args.k3_layers, args.k3_experts)
        k3_batches = [int(b) for b in args.k3_batches.split(",")]
        llm = LLM(model, max_num_seqs=max(k3_batches), pack_cpu_weights=False, **extra)
        name = (
            f"K3-shaped slice ({args.k3_layers} layers, {args.k3_experts} packed MXFP4 experts top-{model.config.moe.num_experts_per_token}, no packed copies)"
        )
        report(name, llm, k3_batches, argparse.Namespace(**{**vars(args), "steps": args.k3_steps, "rounds": 1}), read_bw, fma)
        llm.close()
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    return 0


def k3_slice_model(layers: int, experts: int) -> Any:
    """The slice with random weights; routed experts as random packed MXFP4 (codes uniform, scales 2^-6 .. 2^-3)."""
    from openk3.model import K3ForCausalLM, OpChoice
    from openk3.model.moe import PackedExperts

    model = K3ForCausalLM(k3_slice(layers, experts), ops=OpChoice(packed_experts=True))
    model.init_weights(0)
    gen = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, PackedExperts):
            for name, buf in m.named_buffers():
                if name.endswith("_packed"):
                    buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))
                else:
                    buf.copy_(torch.randint(121, 125, buf.shape, dtype=torch.uint8, generator=gen))
    return model.eval()


if __name__ == "__main__":
    sys.exit(main())
