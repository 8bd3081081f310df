"""Who can run a layout as the planner prices it: openk3 today, and which serving engines offer the features it assumes.

The planner prices DP attention (trunk replicated, each rank its own batch) or TP attention, expert parallelism with
EPLB or MoonEP balance, FP8 dispatch, and a fraction of communication hidden by two-batch overlap. openk3's own runtime
(docs/ep.md) serves expert parallelism with attention *replicated*: every rank runs the whole batch that rank 0
schedules, dispatching 1/W of its tokens; it has no tensor parallelism, overlaps no communication, dispatches in the
activation dtype, and its multi-rank path has run on CPU/gloo only. So on more than one accelerator no layout the
planner prices is what openk3 runs today; a single accelerator is.

Engines are matched on documented features only (DP attention, TP, wide EP with EPLB/redundant experts, two-batch
overlap): SGLang (`--enable-dp-attention`, `--enable-two-batch-overlap`, EPLB), vLLM (`--data-parallel-size` with
`--enable-expert-parallel`, `--enable-eplb`, dual-batch overlap), TensorRT-LLM (attention DP, wide EP with EPLB). Whether
an engine supports the model itself (KDA, AttnRes) is not checked. MoonEP's per-batch balancing is a library
(MoonshotAI/MoonEP) that none of the three documents as integrated, so a MoonEP layout names no engine but openk3.
"""

from __future__ import annotations

from dataclasses import dataclass

from openk3.planner.inputs import Balance, Layout, Quantisation

ENGINES = ("SGLang", "vLLM", "TensorRT-LLM")


@dataclass(frozen=True)
class Support:
    openk3: bool
    openk3_missing: tuple[str, ...]  # what openk3 lacks to run the layout as priced (empty when it runs it)
    engines: tuple[str, ...]  # engines whose documented features cover the layout

    def describe(self) -> str:
        ours = "openk3: yes" if self.openk3 else f"openk3: no ({'; '.join(self.openk3_missing)})"
        return f"{ours}; engines: {', '.join(self.engines) if self.engines else 'none known'}"


def support(layout: Layout, comm_overlap: float, quant: Quantisation) -> Support:
    missing: list[str] = []
    if layout.num_accelerators > 1:
        if layout.tp > 1:
            missing.append(f"TP{layout.tp} attention (openk3 has no tensor parallelism)")
        else:
            missing.append("DP attention (openk3's EP serving replicates attention: every rank runs the whole batch)")
        if comm_overlap > 0:
            missing.append(f"two-batch overlap hiding {comm_overlap:.0%} of communication (openk3 overlaps none)")
        if quant.dispatch_bits < 16:
            missing.append("FP8 dispatch (openk3 dispatches in the activation dtype)")
        missing.append("multi-rank serving on CUDA/NCCL (run on CPU/gloo only)")
    engines = () if layout.balance == Balance.MOONEP and layout.num_accelerators > 1 else ENGINES
    return Support(openk3=not missing, openk3_missing=tuple(missing), engines=engines)
