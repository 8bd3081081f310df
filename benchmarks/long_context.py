"""Long prompts on the demo model: prefill time and peak RSS with the MLA prefill "auto" picks now against the form it
picked before (expanded K/V + SDPA, "fast"), same run, same machine.

Each (length, form) runs in a child process of its own, so that its peak RSS (VmHWM) is that prefill's alone: it
builds the embedded tiny model, takes the RSS, then generates one greedy token (with its logprob) for a random prompt of
`length` tokens in chunks of `--chunk` tokens (the engine's default step budget). Reported per row: the time to the
first token (the prefill), the peak RSS and its growth over the RSS of the loaded engine, and the MLA cache bytes of the
prompt. A row's speed-up is refused (reported as "mismatch") unless its token equals the baseline's and the logprobs
agree to 1e-3.

Before the engine rows, one table of the op alone at the demo model's MLA sizes: a chunk of t queries against s keys,
the old form against the new, interleaved (median of 3 rounds), with the largest error against the fp32 reference where
s <= 8192 (the reference's own memory grows with s).

    python benchmarks/long_context.py                                  # 2k and 8k: a few minutes on 2 cores
    python benchmarks/long_context.py --lengths 8192,32768,65536      # the issue's sizes (the 64k baseline: minutes)
    python benchmarks/long_context.py --cp 2                          # also LLM(cp=2): prefill chunks split over 2 ranks
    python benchmarks/long_context.py --cp 2 --cp-tp 2 --cp-prefix-caching  # that row as LLM(cp=2, tp=2, prefix caching on)
    python benchmarks/long_context.py --lengths 1048576 --dtype bf16 --no-baseline --op-sizes "" --decode-tokens 9  # 1M tokens
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time

BASELINE, NEW = "fast", "auto"


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _rss_mb() -> float:
    return _status_mb("VmRSS")


def _peak_mb() -> float:
    """This process's own RSS high-water mark. Not ru_maxrss: Linux carries the parent's high-water mark into a child that
    was spawned (vfork + exec) into its ru_maxrss, so every child reported the op table's ~3 GB peak as its own."""
    return _status_mb("VmHWM")


DTYPES = ("fp32", "bf16")


def child(length: int, form: str, chunk: int, cp: int = 1, tp: int = 1, prefix_caching: bool = False, dtype: str = "fp32", decode: int = 1) -> dict:
    import torch

    from openk3.llm import LLM
    from openk3.serve.sampling import SamplingParams

    torch.manual_seed(0)
    split: dict = {}
    if cp > 1:  # every rank one thread (the workers' ep_threads default): cp ranks use as many cores as one rank's default threads
        torch.set_num_threads(1)
        split = dict(cp=cp, tp=tp, cp_min_tokens=min(256, chunk), enable_prefix_caching=prefix_caching)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    max_len = length + decode + 8
    pages = -(-max_len // 16)  # the prompt's pages exactly: the default budget holds ~700k tokens
    llm = LLM(
        "tiny",
        ops=f"mla={form}",
        dtype=torch_dtype,
        max_model_len=max_len,
        page_size=16,
        num_pages=pages,
        max_num_batched_tokens=chunk,
        max_num_seqs=1,
        **split,
    )
    prompt = [random.Random(length).randrange(1000) for _ in range(length)]
    llm.generate([prompt[:16]], SamplingParams(temperature=0, max_tokens=1))  # warm-up: kernels built, pools touched
    loaded = _rss_mb()
    start = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=decode, ignore_eos=True, logprobs=0))[0]
    seconds = time.perf_counter() - start
    logprobs, metrics = out.outputs[0].logprobs, out.outputs[0].metrics
    assert logprobs is not None and metrics is not None and metrics.time_to_first_token is not None
    cfg = llm.engine.model.config
    cache_mb = length * len(cfg.mla_layers) * cfg.mla.latent_dim * torch_dtype.itemsize / 2**20
    peak = _peak_mb()
    llm.close()
    return {"seconds": metrics.time_to_first_token if decode > 1 else seconds, "tpot": metrics.time_per_output_token, "peak": peak,
            "loaded": loaded, "cache": cache_mb, "token": out.token_ids[0], "logprob": logprobs[0].logprob}  # fmt: skip


def measure(length: int, form: str, chunk: int, cp: int = 1, tp: int = 1, prefix_caching: bool = False, dtype: str = "fp32", decode: int = 1) -> dict:
    cmd = [sys.executable, __file__, "--child", f"{length},{form},{chunk},{cp},{tp},{int(prefix_caching)},{dtype},{decode}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[1:])} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def op_table(sizes: list[tuple[int, int]]) -> None:
    import torch

    from openk3.config import tiny
    from openk3.ops.mla import mla_expanded
    from openk3.ops.registry import registry

    m = tiny().mla
    old, new = registry().get("mla_prefill", BASELINE), registry().get("mla_prefill", NEW)
    print("| t queries | s keys | old ms | new ms | speed-up | max error vs reference |")
    print("|---|---|---|---|---|---|")
    for t, s in sizes:
        torch.manual_seed(t + s)
        r = torch.randn
        a = (r(t, m.num_heads, m.qk_nope_head_dim), r(t, m.num_heads, m.qk_rope_head_dim), r(s, m.kv_lora_rank), r(s, m.qk_rope_head_dim))
        w = (r(m.num_heads, m.qk_nope_head_dim, m.kv_lora_rank) * 0.1, r(m.num_heads, m.v_head_dim, m.kv_lora_rank) * 0.1)
        args = (*a, *w, m.qk_head_dim**-0.5, s - t)
        err = f"{(new(*args) - mla_expanded(*args)).abs().max().item():.1e}" if s <= 8192 else "-"
        times: dict[str, list[float]] = {"old": [], "new": []}
        reps = max(1, min(20, int(2e6 // (t * s))))
        for _ in range(3):
            for name, fn in (("old", old), ("new", new)):
                start = time.perf_counter()
                for _ in range(reps):
                    fn(*args)
                times[name].append((time.perf_counter() - start) / reps * 1e3)
        o, n = sorted(times["old"])[1], sorted(times["new"])[1]
        print(f"| {t} | {s} | {o:.2f} | {n:.2f} | {o / n:.2f}x | {err} |", flush=True)
    print()


def median_run(runs: list[dict]) -> dict:
    """The run of median prefill time, with the largest peak of all (the peaks differ by allocator noise only)."""
    ordered = sorted(runs, key=lambda r: r["seconds"])
    return {**ordered[(len(ordered) - 1) // 2], "peak": max(r["peak"] for r in runs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="2048,8192", help="comma-separated prompt lengths")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (max_num_batched_tokens)")
    p.add_argument("--op-sizes", default="1x1,16x16,128x128,512x512,2048x2048,256x4096,2048x8192,2048x32768", help="op table: TxS,...")
    p.add_argument("--repeats", type=int, default=1, help="runs per (length, form), interleaved; the median time is reported")
    p.add_argument("--cp", type=int, default=1, help="also a row per length with LLM(cp=N): the prefill chunks split over N ranks (rank 0's peak)")
    p.add_argument("--cp-tp", type=int, default=1, help="the --cp row's TP ranks per CP rank (cp x tp ranks)")
    p.add_argument("--cp-prefix-caching", action="store_true", help="the --cp row with prefix caching on (its snapshots taken inside the split chunks)")
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="the model's dtype in every row (bf16: torch's CPU flash in bf16, fp32 accumulation)")
    p.add_argument("--decode-tokens", type=int, default=1, help="tokens generated per row; above 1 the prefill column is the TTFT and a TPOT column is added")
    p.add_argument("--no-baseline", action="store_true", help="no expanded-K/V row (its memory at 1M tokens is tens of GB): the new form's rows only")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        length, form, chunk, cp, tp, pc, dtype, decode = args.child.split(",")
        print(json.dumps(child(int(length), form, int(chunk), int(cp), int(tp), pc == "1", dtype, int(decode))))
        return
    if args.decode_tokens < 1:
        p.error("--decode-tokens must be at least 1")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    where = platform.processor() or platform.machine()
    flags = f"--lengths {args.lengths} --chunk {args.chunk} --repeats {args.repeats} --op-sizes {args.op_sizes}"
    flags += (f" --cp {args.cp} --cp-tp {args.cp_tp}" + " --cp-prefix-caching" * args.cp_prefix_caching) if args.cp > 1 else ""
    flags += f" --dtype {args.dtype}" * (args.dtype != "fp32") + f" --decode-tokens {args.decode_tokens}" * (args.decode_tokens > 1)
    flags += " --no-baseline" * args.no_baseline
    print(f"command: python benchmarks/long_context.py {flags}; commit {commit}; {where}, {os.cpu_count()} CPUs")
    op_table([(int(t), int(s)) for t, s in (x.split("x") for x in args.op_sizes.split(",") if x)])
    print(f"baseline: --ops mla={BASELINE} (the old auto: K/V expanded for the whole context + SDPA); new: mla={NEW} (the registry's rule)\n")
    tpot = args.decode_tokens > 1
    print("| prompt tokens | MLA cache MB | form | prefill s |" + " TPOT ms |" * tpot + " peak RSS MB | peak - loaded MB | speed-up vs baseline | peak ratio |")
    print("|---|---|---|---|" + "---|" * tpot + "---|---|---|---|")
    for length in (int(x) for x in args.lengths.split(",")):
        cp_row = f"{NEW}, cp={args.cp}" + f" x tp={args.cp_tp}" * (args.cp_tp > 1) + ", prefix caching" * args.cp_prefix_caching
        rows = ((BASELINE,) if not args.no_baseline else ()) + (NEW,) + ((cp_row,) if args.cp > 1 else ())
        runs: dict[str, list[dict]] = {name: [] for name in rows}
        for _ in range(args.repeats):  # interleaved: a shared machine's load moves within minutes
            for name in rows:
                cp, tp, pc = (args.cp, args.cp_tp, args.cp_prefix_caching) if name == cp_row else (1, 1, False)
                runs[name].append(measure(length, NEW if name == cp_row else name, args.chunk, cp, tp, pc, args.dtype, args.decode_tokens))
        results = {name: median_run(runs[name]) for name in rows}
        base = results.get(BASELINE)
        for name, r in results.items():
            if base is None:
                ratio, peak = "-", "-"
            elif r is base:
                ratio, peak = "1.00x", "1.00"
            else:
                same = base["token"] == r["token"] and abs(base["logprob"] - r["logprob"]) <= 1e-3
                ratio, peak = (f"{base['seconds'] / r['seconds']:.2f}x" if same else "mismatch"), f"{r['peak'] / base['peak']:.2f}"
            grown = r["peak"] - r["loaded"]
            per_token = f" {r['tpot'] * 1e3:.1f} |" if tpot else ""
            print(f"| {length} | {r['cache']:.1f} | {name} | {r['seconds']:.1f} |{per_token} {r['peak']:.0f} | {grown:.0f} | {ratio} | {peak} |", flush=True)
            print(f"  (first token {r['token']}, logprob {r['logprob']:.4f})", flush=True)


if __name__ == "__main__":
    main()
