"""The FP8 MLA latent cache against the full-precision one on the demo model, on held-out text (the chapters the demo's
training never saw, openk3/train/data.py split_documents):

- teacher-forced: the logprob the model gives each actual next token of a chapter's first `--score-tokens` tokens, scored
  in the prefill (prompt_logprobs), full-precision cache vs FP8 cache: mean and largest |difference|, and the held-out
  loss (mean negative logprob) of each;
- free-running: greedy continuations of `--gen-tokens` tokens from each chapter's first `--prompt-tokens` tokens: the
  share of continuations identical token for token, and the share of tokens before the first divergence;
- bytes per token of the MLA cache, the demo model's and K3's (CacheSpec), full precision vs FP8.

    python benchmarks/fp8_latent_cache.py                    # 12 chapters: a few minutes on 2 cores
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import warnings

import torch

from openk3.config import preset
from openk3.llm import LLM
from openk3.serve.cache.spec import CacheSpec
from openk3.serve.sampling import SamplingParams
from openk3.train.data import kjv_chapters, split_documents


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(kv_cache_dtype: str, texts: list[list[int]], args: argparse.Namespace) -> tuple[list[list[float]], list[tuple[int, ...]]]:
    with LLM("tiny", max_num_seqs=4, kv_cache_dtype=kv_cache_dtype, dtype="float32") as llm:
        scored = llm.generate([t[: args.score_tokens] for t in texts], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
        logprobs = [[p.logprob for p in o.prompt_logprobs or () if p is not None] for o in scored]
        gen = llm.generate([t[: args.prompt_tokens] for t in texts], SamplingParams(max_tokens=args.gen_tokens, temperature=0, ignore_eos=True))
        return logprobs, [o.outputs[0].token_ids for o in gen]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chapters", type=int, default=12)
    p.add_argument("--score-tokens", type=int, default=512)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=64)
    args = p.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    _, held = split_documents(kjv_chapters())
    with LLM("tiny", max_num_seqs=1) as llm:
        tok = llm.tokenizer
    texts = [ids for ids in (tok.encode(d) for d in held) if len(ids) >= args.score_tokens][: args.chapters]
    full_lp, full_gen = run("auto", texts, args)
    fp8_lp, fp8_gen = run("fp8", texts, args)
    diffs = [abs(a - b) for x, y in zip(full_lp, fp8_lp, strict=True) for a, b in zip(x, y, strict=True)]
    loss = lambda lps: -sum(sum(x) for x in lps) / sum(len(x) for x in lps)  # noqa: E731
    same = sum(a == b for a, b in zip(full_gen, fp8_gen, strict=True))
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x)) for x, y in zip(full_gen, fp8_gen, strict=True)]
    print(f"# FP8 latent cache vs full precision: demo model (fp32), {len(texts)} held-out chapters; commit {commit()}, {platform.machine()}")
    print("    python benchmarks/fp8_latent_cache.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()))
    print()
    print("| measure | value |")
    print("|---|---|")
    print(f"| teacher-forced tokens scored | {len(diffs)} |")
    print(f"| mean / max abs logprob difference | {sum(diffs) / len(diffs):.5f} / {max(diffs):.4f} |")
    print(f"| held-out loss, full-precision cache | {loss(full_lp):.4f} |")
    print(f"| held-out loss, FP8 cache | {loss(fp8_lp):.4f} |")
    print(f"| greedy continuations identical ({args.gen_tokens} tokens) | {same} / {len(texts)} |")
    print(f"| tokens before the first divergence | {sum(prefix) / (len(prefix) * args.gen_tokens):.1%} |")
    for name in ("tiny", "k3"):
        config = preset(name)
        full = CacheSpec.from_config(config, 64, cache_dtype_bytes=2).mla.bytes_per_token
        fp8 = CacheSpec.from_config(config, 64, cache_dtype_bytes=2, fp8_latent=True).mla.bytes_per_token
        print(f"| MLA cache bytes per token, {name}: bf16 / FP8 | {full:,} / {fp8:,} ({fp8 / full:.3f}x) |")


if __name__ == "__main__":
    main()
