"""Decode after a long prompt on the demo model: one rank, cp ranks with the cache replicated (what `--cp` alone does:
every rank holds every latent and runs every decode step whole), and cp ranks with decode context parallelism (`--cp
--dcp`: each rank holds its interleaved share of the MLA pages, attends over it, and the parts are merged by LSE), in the
same run, interleaved per repeat.

Per prompt length and repeat, in turn: (a) rank 0 alone prefills the prompt (untimed) and decodes `--tokens` greedy
tokens, 1 thread (the other ranks wait in a barrier); (b) every rank prefills it context-parallel and decodes the same
tokens whole, in lockstep; (c) the same with the pages sharded. Time per output token: the median over the repeats of
(decode wall time / tokens), timed on rank 0 from a barrier before the first step to one after the last (so the slowest
rank counts); and rank 0's CPU time per token (process time over the decode steps, its gloo threads included, not the
wait for the slowest rank), which a machine shared with other jobs disturbs less than the wall clock. A row's ratios are
refused ("mismatch") unless (b) and (c) decode the tokens of (a).

MLA cache bytes per rank: the pages the sequence uses (prompt + output) times what a page costs that rank in every MLA
layer -- the block pool's measure, not RSS. Decode bytes: what a rank receives per MLA layer per decode step under (c),
the other ranks' (out, lse) parts, against zero for (a) and (b).

    python benchmarks/decode_cp.py                                  # 2k and 16k tokens, cp=2, 16 tokens, 3 repeats
    python benchmarks/decode_cp.py --lengths 32768 --tokens 8 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time

import torch
import torch.distributed as dist

PAGE_SIZE = 64


def _decode(model, cache, first: int, length: int, pages: torch.Tensor, tokens: int) -> tuple[float, float, list[int]]:  # type: ignore[no-untyped-def]
    from openk3.model import ForwardBatch

    out, token = [], first
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        for i in range(tokens):
            batch = ForwardBatch.for_step([[token]], [length + i], [0], pages[None])
            token = int(model(batch, cache)[-1].argmax())
            out.append(token)
    cpu = time.process_time() - cpu  # this rank's own work (its gloo threads included), not the wait for the slowest
    dist.barrier()
    return (time.perf_counter() - start) / tokens, cpu / tokens, out


def _one_rank(world, model, ids: list[int], tokens: int) -> tuple[float, float, list[int], int]:  # type: ignore[no-untyped-def]
    from openk3.model import CacheTensors, ForwardBatch

    pages = torch.arange(-(-(len(ids) + tokens) // PAGE_SIZE))
    cache = CacheTensors.allocate(model.config, num_slots=1, num_pages=pages.numel(), page_size=PAGE_SIZE)
    dist.barrier()
    if world.rank != 0:
        dist.barrier()
        dist.barrier()
        return 0.0, 0.0, [], 0
    with torch.no_grad():
        first = int(model(ForwardBatch.for_step([ids], [0], [0], pages[None]), cache)[-1].argmax())
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    with torch.no_grad():
        out, token = [], first
        for i in range(tokens):
            token = int(model(ForwardBatch.for_step([[token]], [len(ids) + i], [0], pages[None]), cache)[-1].argmax())
            out.append(token)
    per_token, cpu = (time.perf_counter() - start) / tokens, (time.process_time() - cpu) / tokens
    dist.barrier()
    return per_token, cpu, [first, *out], sum(p.nbytes for p in cache.mla_latent)


def _context_parallel(ctx, model, ids: list[int], tokens: int, sharded: bool) -> tuple[float, float, list[int], int]:  # type: ignore[no-untyped-def]
    from contextlib import nullcontext

    from openk3.model import CacheTensors
    from openk3.parallel.cp.prefill import context_parallel_prefill
    from openk3.parallel.cp.sharded_mla import LatentShards, sharded_mla_layers

    shards = LatentShards(ctx.rank, ctx.world_size) if sharded else None
    pages = torch.arange(-(-(len(ids) + tokens) // PAGE_SIZE))
    cache = CacheTensors.allocate(model.config, 1, pages.numel(), PAGE_SIZE, latent_shards=ctx.world_size if sharded else 1)
    dist.barrier()
    first = int(context_parallel_prefill(model, ctx, ids, cache, 0, pages, latent_shards=shards).logits[-1].argmax())
    with sharded_mla_layers(model, shards, ctx) if shards is not None else nullcontext():
        per_token, cpu, out = _decode(model, cache, first, len(ids), pages, tokens)
    return per_token, cpu, [first, *out], sum(p.nbytes for p in cache.mla_latent)


def rank_main(world, lengths: list[int], tokens: int, repeats: int) -> list[dict]:  # type: ignore[no-untyped-def]
    from openk3.parallel.serving.ranks import RankModelSpec, build_rank_model

    torch.set_num_threads(1)
    spec = RankModelSpec("tiny", "ep", torch.float32, 0, False, None, tp=1, ep=False)
    model, _ = build_rank_model(spec, world, world)
    rows = []
    for length in [64, *lengths]:  # the first, short one is the warm-up and is not reported
        ids = torch.randint(0, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        times: dict[str, list[float]] = {k: [] for k in ("one", "cp", "dcp", "one_cpu", "cp_cpu", "dcp_cpu")}
        row: dict = {"length": length}
        for _ in range(repeats):
            for name in ("one", "cp", "dcp"):
                run = _one_rank(world, model, ids, tokens) if name == "one" else _context_parallel(world, model, ids, tokens, name == "dcp")
                s, cpu, out, nbytes = run
                times[name].append(s)
                times[name + "_cpu"].append(cpu)
                row[name + "_tokens"], row[name + "_bytes"] = out, nbytes
        row.update({k: statistics.median(v) for k, v in times.items()})
        rows.append(row)
    return rows[1:]


def main() -> None:
    from openk3.model.weights import config_from_hf
    from openk3.parallel.launch import run_ranks
    from openk3.serve.loading import resolve_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,16384", help="prompt lengths, comma-separated")
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--tokens", type=int, default=16, help="greedy output tokens decoded per run")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    results = run_ranks(rank_main, a.cp, lengths, a.tokens, a.repeats)
    path = resolve_model("tiny")
    assert path is not None
    m = config_from_hf(path).mla
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"command: python benchmarks/decode_cp.py --lengths {a.lengths} --cp {a.cp} --tokens {a.tokens} --repeats {a.repeats}; commit {commit}")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs shared (load avg. after: {load}); demo model, fp32, 1 thread per rank\n")
    part = (a.cp - 1) * m.num_heads * (m.v_head_dim + 1) * 4  # the other ranks' (out [H, Dv], lse [H]) per sequence, fp32
    columns = ["prompt", "MLA cache B/rank: one / cp / cp+dcp", "ms/token: one", f"cp={a.cp}", f"cp={a.cp}+dcp", "one / cp", "one / cp+dcp"]
    columns += ["cp / cp+dcp", "rank 0 CPU ms/token: one / cp / cp+dcp", "cp / cp+dcp (CPU)", "dcp decode B recv/MLA layer/step (from shapes)"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for i, length in enumerate(lengths):
        r0 = results[0][i]
        ok = r0["cp_tokens"] == r0["one_tokens"] == r0["dcp_tokens"] and all(res[i]["dcp_tokens"] == r0["one_tokens"] for res in results)
        cache = f"{r0['one_bytes']:,} / {r0['cp_bytes']:,} / {r0['dcp_bytes']:,}"
        ms = [f"{1e3 * r0[k]:.2f}" for k in ("one", "cp", "dcp")]
        ratios = [f"{r0[x] / r0[y]:.2f}x" if ok else "mismatch" for x, y in (("one", "cp"), ("one", "dcp"), ("cp", "dcp"))]
        cpu = " / ".join(f"{1e3 * r0[k + '_cpu']:.2f}" for k in ("one", "cp", "dcp"))
        cpu_ratio = f"{r0['cp_cpu'] / r0['dcp_cpu']:.2f}x" if ok else "mismatch"
        print(f"| {length} | {cache} | {' | '.join(ms)} | {' | '.join(ratios)} | {cpu} | {cpu_ratio} | {part} |")


if __name__ == "__main__":
    main()
