"""Context-parallel prefill on the demo model: prefill time on one rank against `cp` gloo ranks (same run, interleaved),
and the bytes each rank received per layer against the planner's CP communication term (openk3/planner/pp_cp.py).

Every rank loads the embedded tiny model and runs one short warm-up of both forms. Per prompt length and repeat, in turn:
(a) rank 0 alone prefills the whole prompt in one step, 1 thread (the other ranks wait in a barrier); (b) the `cp` ranks
run `context_parallel_prefill`, 1 thread each (timed from a barrier before to a barrier after, so the slowest rank
counts). Reported: medians and the ratio (a)/(b). (A one-rank baseline with `cp` threads is not reported: the ranks
waiting in gloo's barrier keep the other core busy, which made it meaningless on this 2-core machine.) A row's speed-up is refused ("mismatch") unless the
CP logits equal the one-process logits to 1e-3 and the greedy next token is the same.

With `--tp T` every CP rank is a TP group of T ranks (cp x T gloo ranks, rank r TP rank r % T of CP rank r // T, each
holding its TP shard of the checkpoint), and the baseline is the first TP group prefilling the whole prompt alone.

Bytes: what each rank logged as received (payload, not the all-gather's padding), per MLA layer (the other ranks'
latents) and per KDA layer (the conv window and state from the previous rank; with `--kda-cp scan` the conv window and
the other ranks' state maps), against `cp_bytes` of the planner for the same model, prompt, cp, tp, KDA form and an
fp32 cache (the CPU cache dtype); the planner prices one TP rank's share. `--kda-cp both` times the two KDA forms
interleaved in one run (parallel/cp/kda_scan.py).

    python benchmarks/context_parallel.py                              # 2k and 8k tokens, cp=2, 3 repeats
    python benchmarks/context_parallel.py --lengths 4096 --repeats 5
    python benchmarks/context_parallel.py --lengths 1024 --cp 2 --tp 2  # 4 ranks
    python benchmarks/context_parallel.py --lengths 4096 --cp 3 --kda-cp both
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


def _one_rank(ctx, model, ids: list[int], tp: int) -> tuple[float, torch.Tensor | None]:  # type: ignore[no-untyped-def]
    """Rank 0 alone (with --tp, the TP group of ranks 0..tp-1) prefills the whole prompt in one step; the others wait."""
    from openk3.model import CacheTensors, ForwardBatch

    dist.barrier()
    logits, seconds = None, 0.0
    if ctx.rank < tp:
        pages = torch.arange(-(-len(ids) // PAGE_SIZE))
        cache = CacheTensors.allocate(model.config, num_slots=1, num_pages=pages.numel(), page_size=PAGE_SIZE)
        batch = ForwardBatch.for_step([ids], [0], [0], pages[None], only_last_logits=False)
        start = time.perf_counter()
        with torch.no_grad():
            logits = model(batch, cache)
        seconds = time.perf_counter() - start
    dist.barrier()
    return seconds, logits


def _context_parallel(ctx, model, ids: list[int], kda_scan: bool):  # type: ignore[no-untyped-def]
    from openk3.model import CacheTensors
    from openk3.parallel.cp.prefill import context_parallel_prefill

    pages = torch.arange(-(-len(ids) // PAGE_SIZE))
    cache = CacheTensors.allocate(model.config, num_slots=1, num_pages=pages.numel(), page_size=PAGE_SIZE)
    dist.barrier()
    start = time.perf_counter()
    out = context_parallel_prefill(model, ctx, ids, cache, 0, pages, kda_scan=kda_scan)
    local = time.perf_counter() - start  # this rank's own part, before waiting for the slowest
    dist.barrier()
    return time.perf_counter() - start, local, out


def rank_main(world, lengths: list[int], repeats: int, cp: int, tp: int, forms: list[str]) -> list[dict]:  # type: ignore[no-untyped-def]
    from openk3.parallel.serving.rank_groups import context_parallel_groups
    from openk3.parallel.serving.ranks import RankModelSpec, build_rank_model

    groups = context_parallel_groups(world, cp, tp)  # rank r: TP rank r % tp of CP rank r // tp
    spec = RankModelSpec("tiny", "ep", torch.float32, 0, False, None, tp=tp, ep=False)
    model, _ = build_rank_model(spec, world, groups.tp)  # with tp > 1 this rank's TP shard, read from the checkpoint
    ctx = groups.cp
    rows = []
    for length in [64, *lengths]:  # the first, short one is the warm-up and is not reported
        ids = torch.randint(0, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        times: dict[str, list[float]] = {"one": [], **{f: [] for f in forms}, **{f"local {f}": [] for f in forms}}
        ref, outs = None, {}
        for _ in range(repeats):
            s, ref = _one_rank(world, model, ids, tp)
            times["one"].append(s)
            for form in forms:  # interleaved with the baseline, repeat by repeat
                s, local, outs[form] = _context_parallel(ctx, model, ids, form == "scan")
                times[form].append(s)
                times[f"local {form}"].append(local)
        row: dict = {"length": length, **{k: statistics.median(v) for k, v in times.items()}}
        for form, out in outs.items():
            mla = _by_layer(out.received, "mla_latent")
            kda: dict = {}
            for what in ("kda_conv", "kda_state", "kda_scan"):
                for k, v in _by_layer(out.received, what).items():
                    kda[k] = kda.get(k, 0) + v
            row[form] = {
                "s": row[form],
                "local": row[f"local {form}"],
                "wait": out.wait_s,
                "mla": statistics.mean(mla.values()) if mla else 0.0,
                "kda": statistics.mean(kda.values()) if kda else 0.0,
                "final": sum(r.nbytes for r in out.received if r.what == "final_state"),
                "error": float((out.logits - ref).abs().max()) if ref is not None else 0.0,
                "same_token": ref is not None and int(out.logits[-1].argmax()) == int(ref[-1].argmax()),
            }
        rows.append(row)
    return rows[1:]


def _by_layer(received, what: str) -> dict:  # type: ignore[no-untyped-def]
    out: dict = {}
    for r in received:
        if r.what == what:
            out[r.layer] = out.get(r.layer, 0) + r.nbytes
    return out


def main() -> None:
    from openk3.model.weights import config_from_hf
    from openk3.parallel.launch import run_ranks
    from openk3.planner.inputs import Quantisation
    from openk3.planner.pp_cp import KDASplit, cp_bytes
    from openk3.serve.loading import resolve_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="2048,8192", help="prompt lengths, comma-separated")
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--tp", type=int, default=1, help="each CP rank a TP group of this many ranks (cp x tp ranks); the baseline is one TP group")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--kda-cp", default="sequential", choices=["sequential", "scan", "both"], help="the KDA form across the ranks (both: each timed, interleaved)"
    )
    a = p.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    forms = ["sequential", "scan"] if a.kda_cp == "both" else [a.kda_cp]
    results = run_ranks(rank_main, a.cp * a.tp, lengths, a.repeats, a.cp, a.tp, forms)
    path = resolve_model("tiny")
    assert path is not None
    config = config_from_hf(path)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    flags = f"--lengths {a.lengths} --cp {a.cp} --tp {a.tp} --repeats {a.repeats} --kda-cp {a.kda_cp}"
    print(f"command: python benchmarks/context_parallel.py {flags}; commit {commit}; ")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs shared (load avg. after: {load}); demo model, fp32, medians of {a.repeats}\n")
    base = "one rank" if a.tp == 1 else f"tp={a.tp}"
    split = f"cp={a.cp}" + (f" x tp={a.tp}" if a.tp > 1 else "")
    columns = ["prompt", "KDA form", f"{base} s", f"{split} s", f"{base} / cp", "max logit diff", "rank: own part s", "rank: KDA wait s"]
    columns += ["rank: MLA B/layer (planner)", "rank: KDA B/layer (planner)", "final state B"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for i, length in enumerate(lengths):
        for form in forms:
            r0 = results[0][i][form]
            ok = r0["error"] <= 1e-3 and r0["same_token"]
            sent = cp_bytes(config, Quantisation(cache_dtype_bytes=4), tp=a.tp, prompt=length, cp=a.cp, kda=KDASplit(form))
            ratio = f"{results[0][i]['one'] / r0['s']:.2f}x" if ok else "mismatch"
            own = ", ".join(f"{r}: {res[i][form]['local']:.2f}" for r, res in enumerate(results))
            waits = ", ".join(f"{r}: {res[i][form]['wait']:.2f}" for r, res in enumerate(results))
            mla = ", ".join(f"{r}: {res[i][form]['mla']:.0f}" for r, res in enumerate(results)) + f" ({sent.mla_per_layer:.0f})"
            kda = ", ".join(f"{r}: {res[i][form]['kda']:.0f}" for r, res in enumerate(results)) + f" ({sent.kda_per_rank:.0f} on ranks > 0)"
            final = ", ".join(f"{r}: {res[i][form]['final']}" for r, res in enumerate(results))
            one = results[0][i]["one"]
            print(f"| {length} | {form} | {one:.2f} | {r0['s']:.2f} | {ratio} | {r0['error']:.1e} | {own} | {waits} | {mla} | {kda} | {final} |")


if __name__ == "__main__":
    main()
