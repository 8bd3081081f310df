"""Expert-parallel communication: bytes per token per MoE layer, expected destinations, and time on the right link tier.

A token's dispatch carries its a2a-width activations (FP8 + scales) to every rank hosting one of its top-k experts; the
combine brings bf16 results back. With per-rank de-duplication a token travels once per destination *rank* (MoonEP,
DeepEP normal kernels inside a node); without it once per expert (DeepEP low-latency kernels). With domain forwarding
(DeepEP normal kernels across nodes) it crosses the NIC once per destination *domain* and NVLink carries it on to the
ranks there. Time per phase is a latency floor plus the bytes of the busiest link over its bandwidth: NVLink inside the
scale-up domain, the NIC outside it.
"""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass

from openk3.checks import fail
from openk3.config import ModelConfig
from openk3.planner.hardware import System
from openk3.planner.inputs import Quantisation
from openk3.planner.memory import a2a_width


class Exchange(str, enum.Enum):
    """How an MoE layer moves tokens between expert-parallel ranks.

    ALL_TO_ALL: each token goes to the ranks of its experts and back (DeepEP, MoonEP, NVLink one-sided all-to-all),
    overlappable with compute (two-batch overlap). ALLGATHER: every rank gathers every rank's tokens, runs its own
    experts on them and reduce-scatters the results back -- TensorRT-LLM's CUTLASS fused MoE under attention data
    parallelism when its all-to-all is not enabled (tensorrt_llm/_torch/modules/fused_moe/fused_moe_cutlass.py:
    `forward_chunk` all-gathers the quantised inputs, then `reducescatter_or_allreduce` on the outputs, one after the
    other on the layer's stream), so the whole batch crosses every link and nothing overlaps it."""

    ALL_TO_ALL = "all-to-all"
    ALLGATHER = "allgather"


@dataclass(frozen=True)
class CommParams:
    """Defaults: floors are the small-message latencies of NVIDIA's one-sided NVLink all-to-all on GB200 NVL72
    (TensorRT-LLM blog 18: 19-28 us dispatch, 31-45 us combine; mid-range taken); link efficiencies are the fraction of
    the per-direction peak that all-to-all kernels reach (DeepEP: ~160 of 200 GB/s NVLink on H800, 39-46 of 50 GB/s RDMA).
    `exchange`: the MoE layer's token exchange (`Exchange`). `forward_by_domain` (with `dedup`): a token crosses the NIC
    once per destination scale-up domain, and the rank it lands on forwards it over NVLink to the ranks of its experts
    there (and the combine reduces it there before the NIC) -- DeepEP's normal (high-throughput) kernels, "asymmetric-domain
    bandwidth forwarding ... from NVLink domain to RDMA domain" (DeepEP README, V1 docs/legacy.md; its
    tests/test_internode.py counts the RDMA bytes as one copy per destination node), following DeepSeek-V3's node-limited
    dispatch (technical report, section 3.2.2). Off: one NIC copy per remote destination rank (MoonEP's per-rank
    de-duplication)."""

    dispatch_floor_s: float = 22e-6
    combine_floor_s: float = 35e-6
    scale_up_efficiency: float = 0.8
    scale_out_efficiency: float = 0.85
    allreduce_floor_s: float = 10e-6
    dedup: bool = True
    exchange: Exchange = Exchange.ALL_TO_ALL
    forward_by_domain: bool = False
    # with `Exchange.ALLGATHER`: the MoE runs the gathered tokens in chunks of at most this many, each chunk gathered,
    # run through the experts (their weights read again) and reduce-scattered on its own; None: one chunk -- what every
    # validation row runs, since TensorRT-LLM's CUTLASS MoE defaults to max_num_tokens x the DP ranks (the gathered
    # budget) in every stored version, the R1 blog's release-0.20 commit included (benchmarks/planner_moe_chunks.py)
    moe_chunk_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("scale_up_efficiency", "scale_out_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                fail("CommParams", name, getattr(self, name), "a fraction in (0, 1]")
        for name in ("dispatch_floor_s", "combine_floor_s", "allreduce_floor_s"):
            if getattr(self, name) < 0:
                fail("CommParams", name, getattr(self, name), "seconds >= 0")
        if not isinstance(self.exchange, Exchange):
            fail("CommParams", "exchange", self.exchange, f"one of {[e.value for e in Exchange]}")
        if self.moe_chunk_tokens is not None and self.moe_chunk_tokens < 1:
            fail("CommParams", "moe_chunk_tokens", self.moe_chunk_tokens, "None or tokens >= 1")
        if self.moe_chunk_tokens is not None and self.exchange != Exchange.ALLGATHER:
            fail("CommParams", "moe_chunk_tokens", self.moe_chunk_tokens, f"None unless exchange is {Exchange.ALLGATHER.value!r}")
        if self.forward_by_domain and not self.dedup:
            fail("CommParams", "forward_by_domain", self.forward_by_domain, "False when dedup is False (one copy per expert goes direct)")


def dispatch_bytes_per_copy(config: ModelConfig, quant: Quantisation) -> float:
    """K3: 3584 FP8 values + 112 E8M0 scales = 3,696 B."""
    return a2a_width(config) * quant.dispatch_bits / 8


def combine_bytes_per_copy(config: ModelConfig, quant: Quantisation) -> float:
    """K3: 3584 bf16 values = 7,168 B."""
    return a2a_width(config) * quant.combine_bits / 8


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)


def _p_rank_missed(num_experts: int, top_k: int, experts_on_rank: int) -> float:
    """P(none of a token's top_k distinct experts is among this rank's experts), uniform routing."""
    if num_experts - experts_on_rank < top_k:
        return 0.0
    return math.exp(_log_comb(num_experts - experts_on_rank, top_k) - _log_comb(num_experts, top_k))


@functools.lru_cache(maxsize=1024)
def expected_destination_ranks(num_experts: int, top_k: int, ranks: int) -> float:
    """Distinct ranks a token's top_k experts live on, experts split as evenly as E/R allows (K3 at EP72: 14.43)."""
    base, extra = divmod(num_experts, ranks)
    sizes = [base + 1] * extra + [base] * (ranks - extra)
    return sum(1.0 - _p_rank_missed(num_experts, top_k, s) for s in sizes)


def remote_domains_per_token(config: ModelConfig, ranks: int, domain: int) -> float:
    """Distinct scale-up domains other than the source's that hold one of a token's top_k experts (uniform routing,
    experts split evenly over the EP group's ranks, `domain` consecutive ranks per domain)."""
    domains = math.ceil(ranks / domain)
    if domains <= 1:
        return 0.0
    e, k = config.moe.num_experts, config.moe.num_experts_per_token
    per_domain = math.ceil(e / ranks) * min(domain, ranks)
    return (domains - 1) * (1.0 - _p_rank_missed(e, k, per_domain))


def copies_per_token(config: ModelConfig, ranks: int, dedup: bool) -> tuple[float, float]:
    """(copies leaving the source rank, of which over the whole fabric) for one token at one MoE layer."""
    e, k = config.moe.num_experts, config.moe.num_experts_per_token
    if ranks == 1:
        return 0.0, 0.0
    own = 1.0 - _p_rank_missed(e, k, math.ceil(e / ranks))
    if dedup:
        return expected_destination_ranks(e, k, ranks) - own, own
    return k * (ranks - 1) / ranks, own


def bytes_per_token_per_layer(config: ModelConfig, quant: Quantisation, destinations: float | None = None) -> float:
    """Dispatch + combine bytes of one token at one MoE layer; destinations defaults to top_k (K3: 16 x 10,864 = 173,824 B)."""
    d = config.moe.num_experts_per_token if destinations is None else destinations
    return d * (dispatch_bytes_per_copy(config, quant) + combine_bytes_per_copy(config, quant))


@dataclass(frozen=True)
class A2ATime:
    dispatch_s: float
    combine_s: float
    scale_out_fraction: float  # of the remote bytes, the part that leaves the scale-up domain

    @property
    def total_s(self) -> float:
        return self.dispatch_s + self.combine_s


def _phase(bytes_out: float, bytes_in: float, floor: float, fraction_out: float, system: System, comm: CommParams) -> float:
    up_bw = system.accelerator.scale_up_bw * comm.scale_up_efficiency
    out_bw = system.scale_out_bw * comm.scale_out_efficiency
    busiest = max(bytes_out, bytes_in)
    t_up = busiest * (1 - fraction_out) / up_bw
    t_out = busiest * fraction_out / out_bw
    return floor + max(t_up, t_out)


def a2a_layer_time(
    config: ModelConfig, quant: Quantisation, ranks: int, system: System, comm: CommParams, tokens_per_rank: float, imbalance: float = 1.0
) -> A2ATime:
    """Dispatch + combine of one MoE layer on the busiest rank: it sends its own tokens' copies and receives
    `imbalance` times the mean share (then sends that many results back in the combine)."""
    if ranks <= 1 or tokens_per_rank <= 0:
        return A2ATime(0.0, 0.0, 0.0)
    remote, _ = copies_per_token(config, ranks, comm.dedup)
    domain = min(system.scale_up_domain, ranks)
    fraction_out = (ranks - domain) / (ranks - 1)
    d_b, c_b = dispatch_bytes_per_copy(config, quant), combine_bytes_per_copy(config, quant)
    if comm.forward_by_domain and ranks > domain:
        # the NIC carries one copy per remote domain; NVLink every rank copy (direct inside the domain, forwarded in the others)
        nic = tokens_per_rank * remote_domains_per_token(config, ranks, domain)
        nvl = tokens_per_rank * remote
        up_bw = system.accelerator.scale_up_bw * comm.scale_up_efficiency
        out_bw = system.scale_out_bw * comm.scale_out_efficiency

        def forwarded(per_copy: float, floor: float) -> float:
            return floor + imbalance * max(nvl * per_copy / up_bw, nic * per_copy / out_bw)

        dispatch, combine = forwarded(d_b, comm.dispatch_floor_s), forwarded(c_b, comm.combine_floor_s)
        return A2ATime(dispatch_s=dispatch, combine_s=combine, scale_out_fraction=nic / nvl if nvl else 0.0)
    copies_out = tokens_per_rank * remote
    copies_in = copies_out * imbalance
    dispatch = _phase(copies_out * d_b, copies_in * d_b, comm.dispatch_floor_s, fraction_out, system, comm)
    combine = _phase(copies_in * c_b, copies_out * c_b, comm.combine_floor_s, fraction_out, system, comm)
    return A2ATime(dispatch_s=dispatch, combine_s=combine, scale_out_fraction=fraction_out)


def moe_chunks(comm: CommParams, gathered_tokens: float) -> int:
    """Chunks an all-gather MoE layer runs `gathered_tokens` (every rank's tokens) in: ceil(tokens / `moe_chunk_tokens`),
    at least one; one without a chunk size or with the all-to-all."""
    if comm.moe_chunk_tokens is None or comm.exchange != Exchange.ALLGATHER or gathered_tokens <= 0:
        return 1
    return max(1, math.ceil(gathered_tokens / comm.moe_chunk_tokens - 1e-9))


def allgather_layer_time(config: ModelConfig, quant: Quantisation, ranks: int, system: System, comm: CommParams, tokens_per_rank: float) -> A2ATime:
    """All-gather of every rank's dispatch-width tokens, then reduce-scatter of the bf16 results (`Exchange.ALLGATHER`):
    each rank receives (and in the reduce-scatter sends) the other ranks' (ranks - 1) x tokens_per_rank rows, whatever the
    routing; the floors and link efficiencies are the all-to-all's."""
    if ranks <= 1 or tokens_per_rank <= 0:
        return A2ATime(0.0, 0.0, 0.0)
    domain = min(system.scale_up_domain, ranks)
    fraction_out = (ranks - domain) / (ranks - 1)
    rows = (ranks - 1) * tokens_per_rank
    d_b, c_b = dispatch_bytes_per_copy(config, quant), combine_bytes_per_copy(config, quant)
    chunks = moe_chunks(comm, ranks * tokens_per_rank)  # each chunk its own collectives: the floors once per chunk
    gather = _phase(rows * d_b, rows * d_b, chunks * comm.dispatch_floor_s, fraction_out, system, comm)
    scatter = _phase(rows * c_b, rows * c_b, chunks * comm.combine_floor_s, fraction_out, system, comm)
    return A2ATime(dispatch_s=gather, combine_s=scatter, scale_out_fraction=fraction_out)


def allreduce_time(bytes_per_rank: float, tp: int, system: System, comm: CommParams) -> float:
    """Ring all-reduce: 2 (tp-1)/tp of the buffer crosses each link. Inside the scale-up domain every link is NVLink;
    a ring that spans domains runs at the pace of its NIC hops."""
    if tp <= 1:
        return 0.0
    if tp <= system.scale_up_domain:
        bw = system.accelerator.scale_up_bw * comm.scale_up_efficiency
    else:
        bw = system.scale_out_bw * comm.scale_out_efficiency
    return comm.allreduce_floor_s + 2 * (tp - 1) / tp * bytes_per_rank / bw


def prefetch_time(num_experts: float, bytes_per_expert: float, ranks: int, system: System, comm: CommParams) -> float:
    """MoonEP pulls remote experts' weights; over NVLink when the EP group fits the domain, else over the NIC."""
    if num_experts <= 0:
        return 0.0
    inside = ranks <= system.scale_up_domain
    bw = system.accelerator.scale_up_bw * comm.scale_up_efficiency if inside else system.scale_out_bw * comm.scale_out_efficiency
    return num_experts * bytes_per_expert / bw
