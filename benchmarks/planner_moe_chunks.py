"""TensorRT-LLM's MoE chunking under attention DP, tried on the R1 blog's explicit DEP8 set-ups (issue 37 round ten).

    PYTHONPATH=. .venv/bin/python benchmarks/planner_moe_chunks.py

TensorRT-LLM's CUTLASS fused MoE under attention DP all-gathers every rank's tokens and runs them in
ceil(gathered tokens / `moe_max_num_tokens`) chunks, each gathered, run through the experts and reduce-scattered on its
own (tensorrt_llm/_torch/modules/fused_moe/fused_moe_cutlass.py, `forward`: `num_chunks`). The default of
`moe_max_num_tokens` differs between versions of that file: `max_num_tokens` x the DP size in some (NVIDIA/TensorRT-LLM
at 000a01de66f0; later ones set it in `ModelConfig.__post_init__`), so a step never chunks; another stored
version falls back to the per-rank `max_num_tokens` when the model config carries none (`self.moe_max_num_tokens =
model_config.moe_max_num_tokens or model_config.max_num_tokens`, beside the MNNVL/DeepEP all-to-all selection; whether
its runtime passed a value was not found), so a DEP8 decode step of 384 rows per rank
with a 1,536-token budget runs in 2 chunks and reads the experts' weights twice. Which rule the R1 blog's commit
(b6261862419c) ran was not found offline, so `CommParams.moe_chunk_tokens` is off by default; this prints what the rule
would make of the blog's two DEP8 rows the planner prices (the 896-sequence row does not fit the planner's HBM fill).

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
from openk3.planner.validation_agg import FP8, R1_FP4_BF16KV, TRTLLM_EXCHANGE, aggregated_tok_s_per_gpu

# (row, quantisation, system, sequences per GPU, max_num_tokens, requests, published output tok/s/GPU): the blog's commands
ROWS: tuple[tuple[str, Quantisation, str, int, int, int, float], ...] = (
    ("DeepSeek-R1 FP4, B200 DEP8, 384 seq/GPU, 16-bit KV, 1K/2K", R1_FP4_BF16KV, "hgx-b200", 384, 1536, 49152, 4548.0),
    ("DeepSeek-R1 FP8, H200 DEP8, 128 seq/GPU, 1K/2K", FP8, "hgx-h200", 128, 1151, 5120, 1436.2),
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
    for name, quant, system, seqs, budget, requests, published in ROWS:
        plain = aggregated_tok_s_per_gpu(deepseek_v3(), quant, RANKS, system, 1024, 2048, None, seqs, budget, requests=requests)
        chunked = aggregated_tok_s_per_gpu(deepseek_v3(), quant, RANKS, system, 1024, 2048, None, seqs, budget, requests=requests, chunk_moe=True)
        comm = replace(TRTLLM_EXCHANGE, moe_chunk_tokens=budget)
        shape = f"{moe_chunks(comm, RANKS * seqs)} / {moe_chunks(comm, RANKS * budget)}"
        print(f"| {name} | {published:,.0f} | {plain:,.0f} | {plain / published - 1:+.1%} | {chunked:,.0f} | {chunked / published - 1:+.1%} | {shape} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
