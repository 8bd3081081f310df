"""The batch and token budget `trtllm-bench throughput` runs at when its command sets neither (issue 37 item 1).

TensorRT-LLM's perf-overview runs pass no `--max_batch_size` or `--max_num_tokens`, so the benchmark picks them with its
own heuristic (github.com/NVIDIA/TensorRT-LLM, tensorrt_llm/bench/tuning/heuristics.py, `finetune_setting`; the same
rule in the older tensorrt_llm/bench/build/tuning.py): from the requests its KV cache holds at ISL + OSL tokens,

- max batch = that count capped at 4,096, rounded up (to 32s with a floor of 64 below 256, to 128s below 1,024, to
  256s above): the runtime admits at most this many requests per scheduler;
- max tokens per iteration = batch x (1 + ISL / OSL), capped at 32,768, rounded up (to 256s with a floor of 2,048
  below 4,096, to 512s below 8,192, to 1,024s above): the budget one iteration shares between the decoding requests
  and the prompt chunks being prefilled.

With attention data parallelism each rank runs its own scheduler. The heuristic has counted the requests per rank
since it learnt about attention DP; the v1.0 version counted them over the whole instance and the runtime applied the
result per rank (`Counting`). These are a benchmark's settings, not the planner's model: validation uses them to price
the run that was published.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import NamedTuple

BATCH_CAP = 4096
TOKEN_CAP = 32768
# `$num_requests` per (ISL, OSL) of the perf-overview runs ("Preparing a Dataset"): the v1.0 page
# (docs/source/performance/perf-overview.md at 00f37686aa85) lists all ten lengths; the current page (03e27c7d5ff0)
# lists its 1024-based ones with the same counts where they overlap in size (1024/1024 and 1000/1000: 3000)
PERF_OVERVIEW_REQUESTS = {
    (128, 128): 30000, (128, 2048): 3000, (128, 4096): 1500, (500, 2000): 3000, (1000, 1000): 3000, (1000, 2000): 1500,
    (2048, 128): 3000, (2048, 2048): 1500, (5000, 500): 1500, (20000, 2000): 1000,
    (1024, 1024): 3000, (8192, 1024): 1500, (1024, 8192): 1500, (32768, 1024): 1000, (1024, 32768): 1000,
}  # fmt: skip


class Counting(str, enum.Enum):
    PER_RANK = "per-rank"  # heuristics.py with enable_attention_dp: each rank's own KV cache
    PER_INSTANCE = "per-instance"  # v1.0's tuning.py: the instance's KV cache, applied per rank


@dataclass(frozen=True)
class BenchSettings:
    max_batch: int  # per scheduler (per attention-DP rank)
    max_tokens: int  # per iteration per scheduler


def _round_up(x: float, step: int) -> int:
    return step * math.ceil(x / step)


def bench_settings(kv_requests: float, isl: int, osl: int) -> BenchSettings:
    """`finetune_setting` with optimistic tuning (pp = 1), from the requests of ISL + OSL tokens the KV cache holds."""
    if kv_requests < 1 or isl < 1 or osl < 1:
        raise ValueError(f"bench_settings needs kv_requests >= 1 and isl, osl >= 1; got {kv_requests}, {isl}, {osl}")
    raw_bs = min(kv_requests, BATCH_CAP)
    raw_tokens = min(raw_bs * (1 + isl / osl), TOKEN_CAP)
    if raw_bs < 256:
        batch = max(64, _round_up(raw_bs, 32))
    elif raw_bs < 1024:
        batch = _round_up(raw_bs, 128)
    else:
        batch = _round_up(raw_bs, 256)
    if raw_tokens < 4096:
        tokens = max(2048, _round_up(raw_tokens, 256))
    elif raw_tokens < 8192:
        tokens = _round_up(raw_tokens, 512)
    else:
        tokens = _round_up(raw_tokens, 1024)
    return BenchSettings(batch, tokens)


class RunShape(NamedTuple):
    requests: int  # admitted in the instance at once
    max_batch: int  # the engine's max batch per rank (its CUDA graphs stop there: `Overheads.engine`)
    max_tokens: int  # token budget per step per rank


def run_shape(kv_limit: int, ranks: int, isl: int, osl: int, counting: Counting) -> RunShape:
    """The run whose instance holds `kv_limit` whole requests over `ranks` attention-DP schedulers: the requests admitted
    (the KV limit unless the benchmark's batch cap is lower), the engine's max batch per rank, and its max tokens per
    iteration, which each step shares between the decoding requests and prompt chunks."""
    per_rank = kv_limit / ranks
    s = bench_settings(per_rank if counting == Counting.PER_RANK else kv_limit, isl, osl)
    return RunShape(min(kv_limit, s.max_batch * ranks), s.max_batch, s.max_tokens)
