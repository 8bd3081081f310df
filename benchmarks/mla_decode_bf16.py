"""MLA decode over a bf16 latent cache at long contexts: the C kernel's bf16 entry against the torch form a bf16 model ran
before it (same run, same inputs, interleaved). One decode token per sequence attending its whole context, at the demo
model's MLA shapes (4 heads, latent rows of 64 + 32); the cache holds the context in bf16 pages of 16 rows, shuffled.

Rows: "torch" is latent_attention_torch (gathers every page as fp32 rows, then two batched products: what the bf16 demo
model's decode ran in benchmarks/results/long_context.md's 1M-token row); "C bf16" is latent_attention_c_bf16 (the
registry's "c_bf16" entry: pages widened to fp32 in the kernel, a page at a time). Ratio = torch / C bf16. Both are checked
against each other (max abs difference) before timing.

  python benchmarks/mla_decode_bf16.py --contexts 65536,1048576 --threads 2
"""

from __future__ import annotations

import argparse
import functools
import platform
import subprocess
import time

import torch

from openk3.config import preset
from openk3.ops.mla.decode_cpu import latent_attention_c_bf16, latent_attention_torch

PAGE = 16


def seconds(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="8192,65536,262144,1048576", help="comma-separated context lengths (tokens)")
    ap.add_argument("--batch", type=int, default=1, help="sequences, each with the whole context")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per form and round (the fastest is kept)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median of their fastest calls is reported")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mla = preset("tiny").mla
    heads, lr, width = mla.num_heads, mla.kv_lora_rank, mla.kv_lora_rank + mla.qk_rope_head_dim
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    command = f"python benchmarks/mla_decode_bf16.py --contexts {args.contexts} --batch {args.batch} --threads {args.threads}"
    print(f"command: {command}; commit {commit}; {platform.machine()}, {args.threads} threads")
    print("| context tokens | batch | cache MB (bf16) | torch ms | C bf16 ms | ratio | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for context in (int(c) for c in args.contexts.split(",")):
        pages = (context + PAGE - 1) // PAGE
        pool = torch.randn(args.batch * pages, PAGE, width, generator=g).bfloat16()
        table = torch.randperm(args.batch * pages, generator=g).view(args.batch, pages)
        lens = torch.full((args.batch,), context, dtype=torch.int64)
        q = torch.randn(args.batch, heads, width, generator=g) * width**-0.5
        with torch.inference_mode():
            want = latent_attention_torch(q, pool, table, lens, lr)
            got = latent_attention_c_bf16(q, pool, table, lens, lr)
            diff = float((want - got).abs().max())
            times: dict[str, list[float]] = {"torch": [], "c": []}
            torch_form = functools.partial(latent_attention_torch, q, pool, table, lens, lr)
            c_form = functools.partial(latent_attention_c_bf16, q, pool, table, lens, lr)
            for _ in range(args.rounds):
                times["torch"].append(seconds(torch_form, args.repeats))
                times["c"].append(seconds(c_form, args.repeats))
        t_torch, t_c = (sorted(v)[len(v) // 2] * 1e3 for v in (times["torch"], times["c"]))
        mb = pool.numel() * pool.element_size() / 2**20
        print(f"| {context} | {args.batch} | {mb:.1f} | {t_torch:.2f} | {t_c:.2f} | {t_torch / t_c:.1f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
