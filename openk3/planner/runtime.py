"""Who can run a layout as the planner prices it: openk3 today, and which serving engines offer the features it assumes.

The planner prices DP attention (trunk replicated, each rank its own batch) or TP attention, expert parallelism with
EPLB or MoonEP balance, FP8 dispatch, and a fraction of communication hidden by two-batch overlap. openk3's own runtime
(docs/parallel.md) runs TP over all of an instance's ranks (`--tp N`, with `--ep N` or experts split by width), and DP
attention (`--dp D`, TP T inside each DP group) with EP over all D x T ranks, behind the HTTP server and offline; not
experts over fewer ranks than the instance. It overlaps no communication, dispatches in the activation
dtype, and its multi-rank path has run on CPU/gloo only. So on more than one accelerator no layout the planner prices is
what openk3 runs today (the GPU path is the first gap); a single accelerator is.

Engines are matched on documented features only (DP attention, TP, wide EP with EPLB/redundant experts, two-batch
overlap), and on the accelerator's vendor (the catalogue's `vendor`): on NVIDIA, SGLang (`--enable-dp-attention`,
`--enable-two-batch-overlap`, EPLB), vLLM (`--data-parallel-size` with `--enable-expert-parallel`, `--enable-eplb`,
dual-batch overlap), TensorRT-LLM (attention DP, wide EP with EPLB); on AMD (ROCm), SGLang (DP attention and wide EP
over AMD's MoRI all-to-all on MI355X: LMSYS blog 2026-05-28, lmsys.org/blog/2026-05-28-mori) and vLLM (ROCm builds,
docs.vllm.ai "Expert Parallel Deployment": DP + EP with its allgather/reduce-scatter backend) -- TensorRT-LLM is CUDA
only. An accelerator whose row names no vendor is matched to no engine. Whether an engine supports the model itself
(KDA, AttnRes) is not checked. MoonEP's per-batch balancing is a library
(MoonshotAI/MoonEP) that none of the three documents as integrated, so a MoonEP layout names no engine but openk3.
Pipeline parallelism for prefill is documented by all three (`--pp-size`, `--pipeline-parallel-size`, `pp_size`);
context parallelism over a KDA recurrence (state handed between ranks, or a chunk-parallel scan) is documented by none
of them, so a CP plan names no engine. openk3 runs no PP; its CP prefill (openk3/parallel/cp: latents all-gathered, the
KDA state handed rank to rank in order, or with --kda-cp scan every rank's at once and their state maps scanned) runs in its engine
over CP x TP ranks (`--cp C --tp T`, experts split by width or `--ep C*T`), every rank running decode whole or, with
`--dcp`, over its share of the MLA pages (merged by log-sum-exp), so not yet the planner's CP layout, whose
attention-DP groups share a prompt's prefill and then decode batches of their own (CP with `--dp` is not built).
"""

from __future__ import annotations

from dataclasses import dataclass

from openk3.planner.hardware import Vendor
from openk3.planner.inputs import Balance, Layout, Quantisation
from openk3.planner.pp_cp import LongPrefill

ENGINES = {Vendor.NVIDIA: ("SGLang", "vLLM", "TensorRT-LLM"), Vendor.AMD: ("SGLang", "vLLM")}
# the GPU stack openk3's multi-rank path would need on each vendor's accelerators
GPU_STACK = {Vendor.NVIDIA: "CUDA/NCCL", Vendor.AMD: "ROCm/RCCL"}


@dataclass(frozen=True)
class Support:
    openk3: bool
    openk3_missing: tuple[str, ...]  # what openk3 lacks to run the layout as priced (empty when it runs it)
    engines: tuple[str, ...]  # engines whose documented features cover the layout

    def describe(self) -> str:
        ours = "openk3: yes" if self.openk3 else f"openk3: no ({'; '.join(self.openk3_missing)})"
        return f"{ours}; engines: {', '.join(self.engines) if self.engines else 'none known'}"


def support(layout: Layout, comm_overlap: float, quant: Quantisation, vendor: Vendor | None, long_prefill: LongPrefill | None = None) -> Support:
    missing: list[str] = []
    pp, cp = (long_prefill.pp, long_prefill.cp) if long_prefill else (1, 1)
    if pp > 1:
        missing.append(f"PP{pp} (openk3 has no pipeline parallelism)")
    if cp > 1:
        # openk3's --cp C --tp T [--ep C*T] is one engine whose CP groups decode one batch together; priced here, each
        # attention-DP group decodes its own batch and only the prefill is shared (docs/parallel.md)
        missing.append(f"CP{cp} beside DP attention (openk3 runs CP over TP groups in one engine, --cp --tp --ep, not with --dp)")
    n = layout.num_accelerators
    if n > 1:
        if layout.ep_size != n:
            missing.append(f"EP{layout.ep_size} with the expert set replicated {n // layout.ep_size}x (openk3 spreads experts over all {n} ranks)")
        if comm_overlap > 0:
            missing.append(f"two-batch overlap hiding {comm_overlap:.0%} of communication (openk3 overlaps none)")
        if quant.dispatch_bits < 16:
            missing.append("FP8 dispatch (openk3 dispatches in the activation dtype)")
        stack = GPU_STACK[vendor] if vendor is not None else "the accelerator's GPU stack"
        missing.append(f"multi-rank serving on {stack} (run on CPU/gloo only)")
    moonep = layout.balance == Balance.MOONEP and layout.num_accelerators > 1
    engines = () if vendor is None or moonep or cp > 1 else ENGINES[vendor]
    return Support(openk3=not missing, openk3_missing=tuple(missing), engines=engines)
