"""Scheduler overheads on top of the kernels: CUDA-graph padding and the host gap per step.

- CUDA-graph padding: a decode step runs the captured graph of the smallest captured batch that holds its sequences
  (per attention group), so the kernels see the padded batch. Default sizes: TensorRT-LLM's benchmark configuration
  (`cuda_graph_config.batch_sizes` in its perf-overview, `enable_padding: true`); above the largest the step runs eager
  at its own size. A plan's engine is set up for the plan's batch: its max batch per attention group is the planned
  one, and engines capture a graph at their max batch (TensorRT-LLM appends `max_batch_size` to the sizes it generates,
  and generates every 8 up to 128; SGLang every 8 up to 256), so the search prices each batch it tries with a graph at
  that batch (`capturing`): steady decode at the planned batch pads nothing, smaller batches pad to the list. The
  validation runs the benchmark's list through the engine's own filter (`engine`: sizes above min(max batch, max
  tokens) dropped, that bound captured instead), so a run whose engine admits 640 sequences pads to 640, not 1,024
  (until issue 37 round seven it padded to the whole list's next size). Padding rows are charged in full, attention included, although
  TensorRT-LLM pads with one dummy request that has no cache: charging attention for the real rows only and refitting
  the host gap left the tuned rows at 11% median |error| against 5% (docs/planner.md, round six), so it was not kept.
- Host gap: time per step the GPU waits on the host (scheduling, sampling, detokenisation hand-off) that the engine's
  overlap scheduler does not hide; a fixed part plus a part per sequence in the step.
- Chunked-prefill mixing: a plan's workload (`workload.py`) time-shares the replica between prefill and decode steps,
  so a replica's busy time per request is its prompt's prefill plus its output's decode steps, and the decode steps
  users see are stretched by the prefill share. The validation prices TensorRT-LLM's runs as the engine steps them,
  decode rows and prompt chunks in one mixed step (`continuous.py`); plans do not use it yet.

The host gap stands for the per-iteration time outside the priced kernels. Its origin is the engines' per-step
scheduler work -- schedule the next batch, check stop criteria, update responses, prepare the inputs -- which their
overlap schedulers now run while the GPU executes the previous step (TensorRT-LLM, nvidia.github.io/TensorRT-LLM/
features/overlap-scheduler.html: step n+1 is launched before step n's stop checks and response updates; vLLM's v0.6.0
performance update, blog.vllm.ai/2024/09/05/perf-update.html: scheduling and input preparation left an H100 idle for
much of a Llama 3 8B step until they were overlapped; SGLang v0.4's overlap scheduler, lmsys.org/blog/
2024-12-04-sglang-v0-4). With that overlap on, pricing the step as max(device, host) leaves the kernels alone and
misses the tuned rows by 17% (issue 37 round seven), so the gap stays additive: it is the host work the overlap does
not hide plus device time per step and per sequence the kernel model lacks (sampling, attention-DP padding, the MoE
all-gather's chunking), not host time alone -- a fixed part plus a part per sequence in the step.

Eager mixed steps (`eager_s_per_layer`, off by default): TensorRT-LLM captures decode-only batches, so a step that
carries a prompt chunk launches its kernels one by one; the option charges such a step a launch cost per layer. The one
published figure is TensorRT-LLM's ablation on DeepSeek-R1 (B200, attention DP 8, 1K/2K: CUDA graphs "22% E2E
performance impact for throughput scenarios", docs/source/blogs/tech_blog/blog3_Optimizing_DeepSeek_R1_Throughput_on_
NVIDIA_Blackwell_GPUs.md), 0.225 ms per layer against the planner's graphed step there. Charged to every mixed step it
takes the new held-out rows beyond 35% from 6 to 2, but the medians rise (held-out 11.1% -> 12.3%, new held-out 11.8%
-> 13.2%; 14.6% and 14.9% with the host gap refitted on the tuned rows), so it stays off (issue 37 round ten,
`benchmarks/planner_eager.py`): one model's per-layer cost does not carry to models with fewer kernels per layer, and
launches overlap a long step's kernels.

The host-gap defaults (2 ms + 20 us per sequence in the step) are the one set of numbers in the step model chosen
against end-to-end runs: a grid over {0, 1, 2, 5, 7.5, 10, 15} ms x {0, 5, 10, 20, 40, 80} us minimising the median
|error| of the tuned rows of `validation_agg.py` (TensorRT-LLM's 1000/1000 and 1024/1024 runs, at trtllm-bench's own
batch and token budget), no held-out row in the fit, with the fixed part at most 2 ms: published batch-1 decode steps
are that short (SGLang, GPT-OSS-120B on B200, 2.41 ms TPOT at concurrency 1; gist.github.com/BenHamm/
78563d0d0a08d7cb61b4737392633384). The tuned rows alone form a ridge (10 ms + 10 us fits them 1.6 points better)
because their batches are all large; the batch-1 bound picks the point on it. History: 2 ms + 40 us until issue 37
round three (the per-sequence part stood in for decode attention, which the per-operator table priced by the product
batch x context; priced by (heads, batch, context) it needs half of that), then 1 ms + 20 us; round seven (each run on
its engine's own graphs, `engine`, the CUTLASS MoE's all-gather exchange, two kernels' own curves) moved the grid's
best on the tuned rows to 2 ms + 20 us (8.8% against 10.0%), applied in round nine (benchmarks/results/planner.md,
"Round nine"; `benchmarks/planner_host_gap.py` prints the grid).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace

from openk3.checks import check_int, fail

TRTLLM_GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 1024, 2048, 4096, 8192)


def sglang_graph_sizes(max_bs: int = 512) -> tuple[int, ...]:
    """The decode batches SGLang captures by default without speculative decoding (`ServerArgs.
    _generate_cuda_graph_batch_sizes`, python/sglang/srt/server_args.py): 1, 2, 4, 8, 12, every 8 from 16 to 256, every
    16 to 496, every 32 from 512 to `max_bs` (`--cuda-graph-max-bs`; 512 on GPUs of 160 GB and more), and `max_bs`
    itself. The validation's SGLang runs pad to these (or to the `--cuda-graph-bs` their scripts list), not to
    TensorRT-LLM's powers of two."""
    check_int("sglang_graph_sizes", "max_bs", max_bs, low=1)
    sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_bs + 1, 32)]
    return tuple(sorted({s for s in sizes if s <= max_bs} | {max_bs}))


@dataclass(frozen=True)
class Overheads:
    host_gap_s: float = 2.0e-3
    host_gap_per_seq_s: float = 20.0e-6
    graph_sizes: tuple[int, ...] = TRTLLM_GRAPH_SIZES  # empty: no CUDA graphs, no padding
    eager_s_per_layer: float = 0.0  # launch time a step that runs outside a captured graph adds per layer

    def __post_init__(self) -> None:
        for name in ("host_gap_s", "host_gap_per_seq_s", "eager_s_per_layer"):
            if not getattr(self, name) >= 0:
                fail("Overheads", name, getattr(self, name), "seconds >= 0")
        if list(self.graph_sizes) != sorted(set(self.graph_sizes)) or any(s < 1 for s in self.graph_sizes):
            fail("Overheads", "graph_sizes", self.graph_sizes, "strictly increasing batch sizes >= 1")

    @classmethod
    def none(cls) -> Overheads:
        return cls(host_gap_s=0.0, host_gap_per_seq_s=0.0, graph_sizes=(), eager_s_per_layer=0.0)

    def padded_batch(self, seqs: float) -> float:
        """The batch a decode step's kernels run at: the smallest captured size >= seqs, or seqs past the largest."""
        if not self.graph_sizes or seqs > self.graph_sizes[-1]:
            return seqs
        return float(self.graph_sizes[bisect.bisect_left(self.graph_sizes, seqs)])

    def capturing(self, batch: int) -> Overheads:
        """The same engine with a graph captured at `batch` as well (its max batch); without graphs, unchanged."""
        if not self.graph_sizes or batch in self.graph_sizes:
            return self
        return replace(self, graph_sizes=tuple(sorted({*self.graph_sizes, batch})))

    def engine(self, max_batch: int, max_tokens: int) -> Overheads:
        """The graphs an engine with this list captures under its own limits (TensorRT-LLM's PyTorch engine,
        tensorrt_llm/_torch/pyexecutor/model_engine.py, `_filter_cuda_graph_batch_sizes`): the sizes up to its largest
        pure-decode batch, min(max batch, max tokens per iteration), and, with padding on and a larger size listed,
        that largest batch itself, to which bigger decode batches then pad; none above it (such batches run eager).
        Without graphs, unchanged."""
        check_int("Overheads.engine", "max_batch", max_batch, low=1)
        check_int("Overheads.engine", "max_tokens", max_tokens, low=1)
        if not self.graph_sizes:
            return self
        top = min(max_batch, max_tokens)
        kept = [s for s in self.graph_sizes if s <= top]
        if len(kept) < len(self.graph_sizes) and (not kept or kept[-1] != top):
            kept.append(top)
        return replace(self, graph_sizes=tuple(kept))

    def host_gap(self, seqs: float) -> float:
        return self.host_gap_s + self.host_gap_per_seq_s * seqs
