"""TensorRT-LLM's MoE chunking under attention DP, tried on the R1 blog's explicit DEP8 set-ups (issue 37 round ten).

    PYTHONPATH=. .venv/bin/python benchmarks/planner_moe_chunks.py

TensorRT-LLM's CUTLASS fused MoE under attention DP all-gathers every rank's tokens and runs them in
ceil(gathered tokens / `moe_max_num_tokens`) chunks, each gathered, run through the experts and reduce-scattered on its
own (tensorrt_llm/_torch/modules/fused_moe/fused_moe_cutlass.py, `forward`: `num_chunks`). Which default the blog's
runs had (issue 37 round eleven): its commit b6261862419c is a release-0.20 commit (a CI record of TensorRT-LLM's
Jenkins files names it as LLM/release-0.20/L0_PostMerge build 35, on images tagged 2025-05-29). Release 0.20's own
file was not found offline, but every stored version of the CUTLASS MoE before and after it defaults
`moe_max_num_tokens` to `max_num_tokens` x the ranks under attention DP: the one-file
tensorrt_llm/_torch/modules/fused_moe.py (NVIDIA/TensorRT-LLM at 01503f5535c0: x the world size; another copy: x the
parallel size), fused_moe_cutlass.py (at 000a01de66f0: x the DP size; later via `ModelConfig.__post_init__`). A
gathered step never exceeds that, so no step chunks. The per-rank fallback that round ten found (`self.moe_max_num_tokens
= model_config.moe_max_num_tokens or model_config.max_num_tokens`) is WideEPMoE's (fused_moe_wide_ep.py), a backend
these runs do not select (their options name no MoE backend, or CUTLASS). So `CommParams.moe_chunk_tokens` stays off
for every validation row; this prints what chunking at the per-rank budget would make of the blog's three DEP8 rows,
each at its command's KV share (`kv_fraction`), to show the size of what the version rules out.

Prints one Markdown table. Pure arithmetic: no device needed.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from dataclasses import replace

from openk3.planner.comm import moe_chunks
from openk3.planner.inputs import Quantisation
from openk3.planner.models import deepseek_v3
from openk3.planner.validation_agg import FP8, R1_FP4, R1_FP4_BF16KV, TRTLLM_EXCHANGE, aggregated_tok_s_per_gpu

# (row, quantisation, system, sequences per GPU, max_num_tokens, requests, published output tok/s/GPU, KV share): the blog's commands
ROWS: tuple[tuple[str, Quantisation, str, int, int, int, float, float], ...] = (
    ("DeepSeek-R1-0528 FP4, B200 DEP8, 896 seq/GPU, FP8 KV, 1K/2K", R1_FP4, "hgx-b200", 896, 2048, 114688, 5393.3, 0.93),
    ("DeepSeek-R1 FP4, B200 DEP8, 384 seq/GPU, 16-bit KV, 1K/2K", R1_FP4_BF16KV, "hgx-b200", 384, 1536, 49152, 4548.0, 0.85),
    ("DeepSeek-R1 FP8, H200 DEP8, 128 seq/GPU, 1K/2K", FP8, "hgx-h200", 128, 1151, 5120, 1436.2, 0.8),
)
RANKS = 8


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> int:
    print(f"command: {' '.join([sys.executable.rsplit('/', 1)[-1], *sys.argv])}; machine: {platform.machine()} {platform.system()}; commit {_commit()}\n")
    print("| row | published | one chunk (shipped) | error | chunks of max_num_tokens | error | chunks: full decode step / full mixed step |")
    print("|---|---|---|---|---|---|---|")
    for name, quant, system, seqs, budget, requests, published, share in ROWS:
        run = (deepseek_v3(), quant, RANKS, system, 1024, 2048, None, seqs, budget)
        plain = aggregated_tok_s_per_gpu(*run, requests=requests, kv_fraction=share)
        chunked = aggregated_tok_s_per_gpu(*run, requests=requests, chunk_moe=True, kv_fraction=share)
        comm = replace(TRTLLM_EXCHANGE, moe_chunk_tokens=budget)
        shape = f"{moe_chunks(comm, RANKS * seqs)} / {moe_chunks(comm, RANKS * budget)}"
        print(f"| {name} | {published:,.0f} | {plain:,.0f} | {plain / published - 1:+.1%} | {chunked:,.0f} | {chunked / published - 1:+.1%} | {shape} |")
    print("\nshipped: one chunk (the release-0.20 CUTLASS MoE's default under attention DP never chunks a step)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
