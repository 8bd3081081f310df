"""What one step of the busiest rank costs, by component, and what a candidate achieves: the types the step model
(perf.py) takes and returns."""

from __future__ import annotations

from dataclasses import dataclass

from openk3.planner.memory import MemoryBreakdown
from openk3.planner.speculative import SpecStep


@dataclass(frozen=True)
class Component:
    name: str
    bytes: float
    flops: float
    time_s: float
    bound: str  # "hbm" or "compute"


@dataclass(frozen=True)
class VerifyShape:
    """A speculative verify step per sequence: `queries` positions (k + 1), `state_passes` extra KDA state reads/writes
    (k per-position states written, plus 2 x P(reject) to copy the kept one), `recompute_tokens` KDA tokens rerun after a
    rejection (expected; 0 with per-position states)."""

    queries: int
    state_passes: float
    recompute_tokens: float


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens a decode step carries (chunked prefill mixed with decode), per attention-DP group: `tokens` over
    `prompts` prompts, each query attending to `mean_keys` keys on average, at a prompt length of `prompt_tokens` (the
    shape the measured prefill-attention curve is read at)."""

    tokens: float
    prompts: float
    mean_keys: float
    prompt_tokens: float


@dataclass(frozen=True)
class StepTime:
    components: tuple[Component, ...]
    comm_s: float  # all communication on the busiest rank before overlap
    exposed_comm_s: float
    imbalance: float
    tokens_per_group: float
    overhead_s: float = 0.0  # host gap the engine does not hide

    @property
    def local_s(self) -> float:
        return sum(c.time_s for c in self.components)

    @property
    def total_s(self) -> float:
        return self.local_s + self.exposed_comm_s + self.overhead_s

    @property
    def bytes(self) -> float:
        return sum(c.bytes for c in self.components)

    @property
    def flops(self) -> float:
        return sum(c.flops for c in self.components)

    @property
    def dominant(self) -> str:
        """The largest time term of the step, whatever limits the batch."""
        by = self.time_by_bound()
        return {"hbm": "HBM bandwidth", "compute": "compute", "interconnect": "interconnect"}[max(by, key=lambda k: by[k])]

    def time_by_bound(self) -> dict[str, float]:
        out = {"hbm": 0.0, "compute": 0.0, "interconnect": self.exposed_comm_s}
        for c in self.components:
            out[c.bound] += c.time_s
        return out


def binding(step: StepTime, memory: MemoryBreakdown, memory_limited: bool) -> str:
    """What stops this candidate from doing better: memory when HBM capacity caps the batch, else the largest time term."""
    if not memory.fits or memory_limited:
        return "memory"
    return step.dominant


@dataclass(frozen=True)
class Metrics:
    memory: MemoryBreakdown
    decode: StepTime
    prefill: StepTime
    throughput_tok_s: float  # decode output tokens/s of the instance
    per_user_tok_s: float
    ttft_s: float
    prefill_tok_s: float
    tokens_per_joule: float  # decode output tokens per joule at the modelled load
    prefill_tokens_per_joule: float
    decode_power_w: float  # mean wall power per accelerator while decoding
    prefill_power_w: float
    usd_per_m_output: float
    usd_per_m_input: float
    binding: str
    num_accelerators: int
    spec: SpecStep | None = None  # the speculative iteration, when the scenario decodes speculatively

    @property
    def per_accelerator_tok_s(self) -> float:
        return self.throughput_tok_s / self.num_accelerators
