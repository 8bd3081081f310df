"""Step time of the busiest rank, decode and prefill, and what it costs.

Each component (trunk GEMMs, routed experts, MLA attention, KDA recurrence, AttnRes) takes
max(bytes / (HBM BW x eff_hbm), FLOPs / (peak x eff)) on its own; components run one after another, so their times
add. Communication per MoE layer (dispatch + combine on the busiest rank, MoonEP weight prefetch) and TP all-reduces
add too, except the `comm_overlap` fraction hidden under compute (two-batch overlap, which needs two micro-batches: with
fewer than two sequences per group nothing is hidden). TP all-reduces run over NVLink inside the scale-up domain and over
the NIC when TP spans domains. The KDA state is read and written every decode step, which is what makes it cost HBM
bandwidth and not only capacity.

Prefill: a chunk of `prefill_chunk` tokens at `kv_len` cached tokens; causal attention, so its queries see kv_len plus
(chunk + 1) / 2 keys on average. TTFT is one prompt's chunks run alone (service time); prefill throughput, $ per input
token and prefill energy come from steps that pack as many whole prompts as a chunk holds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from openk3.checks import fail
from openk3.config import LayerKind, ModelConfig
from openk3.planner.attention import attention_shape
from openk3.planner.balance import BalanceParams, moonep_prefetch_experts, rank_imbalance
from openk3.planner.comm import CommParams, a2a_layer_time, allreduce_time, prefetch_time
from openk3.planner.energy import PowerParams, step_power_w
from openk3.planner.hardware import System
from openk3.planner.inputs import Balance, Layout, Quantisation, Workload
from openk3.planner.memory import (
    DEFAULT_FILL,
    MemoryBreakdown,
    attn_res_slots,
    cache_spec,
    expert_bytes,
    experts_per_rank,
    num_moe_layers,
    trunk_bytes_per_rank,
    weight_bytes,
    working_set,
)
from openk3.planner.op_efficiency import OpCurves, curves_for
from openk3.planner.overheads import Overheads

KDA_FLOPS_PER_STATE_ELEMENT = 6  # decay, k^T v outer product, q S readout: ~3 multiply-adds per state element per token
KDA_CHUNK = 64
KERNEL_MODES = ("measured", "flat")


@dataclass(frozen=True)
class Efficiency:
    """How far from the roofline the kernels and the scheduler run.

    `kernels="flat"` (default): every component takes the flat factors (HBM streaming 80%, GEMMs 50%, attention 30%:
    round numbers between two decode anchors). `kernels="measured"` (`Efficiency.measured()`, `--kernels measured`):
    GEMM, grouped GEMM, MLA attention prefill/decode and TP all-reduce take the measured per-operator curves of the
    accelerator's family (`op_efficiency.py`), by shape; the flat factors then price only what has no curve (KDA,
    AttnRes, GQA attention, an accelerator without curves). 70% of the expert communication hides under compute
    (two-batch overlap); `overheads` adds CUDA-graph padding and the host gap per step (none by default, the measured
    model's fitted ones with `measured()`). docs/planner.md compares both against the validation set: neither is the
    better one everywhere, which is why the default stays. `calibrate` fits the flat factors to a measurement."""

    hbm: float = 0.8
    gemm: float = 0.5
    attention: float = 0.3
    comm_overlap: float = 0.7
    kernels: str = "flat"
    overheads: Overheads = field(default_factory=Overheads.none)

    def __post_init__(self) -> None:
        for name in ("hbm", "gemm", "attention"):
            if not 0 < getattr(self, name) <= 1:
                fail("Efficiency", name, getattr(self, name), "a fraction in (0, 1]")
        if not 0 <= self.comm_overlap <= 1:
            fail("Efficiency", "comm_overlap", self.comm_overlap, "a fraction in [0, 1]")
        if self.kernels not in KERNEL_MODES:
            fail("Efficiency", "kernels", self.kernels, f"one of {KERNEL_MODES}")

    @classmethod
    def ideal(cls) -> Efficiency:
        """Pure roofline: peaks reached, communication fully hidden, no scheduler overhead."""
        return cls(hbm=1.0, gemm=1.0, attention=1.0, comm_overlap=1.0, kernels="flat", overheads=Overheads.none())

    @classmethod
    def measured(cls) -> Efficiency:
        """Measured per-operator curves plus CUDA-graph padding and the fitted host gap (`overheads.py`)."""
        return cls(kernels="measured", overheads=Overheads())

    def curves(self, accelerator: str) -> OpCurves | None:
        return curves_for(accelerator) if self.kernels == "measured" else None


@dataclass(frozen=True)
class Scenario:
    config: ModelConfig
    quant: Quantisation
    layout: Layout
    workload: Workload
    system: System
    efficiency: Efficiency = field(default_factory=Efficiency)
    comm: CommParams = field(default_factory=CommParams)
    balance: BalanceParams = field(default_factory=BalanceParams)
    fill: float = DEFAULT_FILL
    power: PowerParams = field(default_factory=PowerParams)

    def with_(self, **changes: object) -> Scenario:
        return replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Component:
    name: str
    bytes: float
    flops: float
    time_s: float
    bound: str  # "hbm" or "compute"


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


def _component(name: str, nbytes: float, flops: float, peak: float, eff: float, sc: Scenario, measured: float | None = None) -> Component:
    """max(bytes / (BW x eff_hbm), FLOPs / (peak x eff)) with flat factors; with a measured curve's value at this shape,
    the roofline max(bytes / BW, FLOPs / peak) divided by it (the curve already holds whichever bound the kernel hit)."""
    if measured is not None:
        t_mem, t_flop = nbytes / sc.system.accelerator.hbm_bw, flops / peak
        return Component(name, nbytes, flops, max(t_mem, t_flop) / measured, "hbm" if t_mem >= t_flop else "compute")
    t_mem = nbytes / (sc.system.accelerator.hbm_bw * sc.efficiency.hbm)
    t_flop = flops / (peak * eff) if flops else 0.0
    return Component(name, nbytes, flops, max(t_mem, t_flop), "hbm" if t_mem >= t_flop else "compute")


@functools.lru_cache(maxsize=64)
def _trunk_active_params(config: ModelConfig) -> float:
    return config.param_count().active - num_moe_layers(config) * config.moe.num_experts_per_token * config.routed_expert_params()


def _layer_counts(config: ModelConfig) -> tuple[int, int]:
    kinds = config.layer_kinds
    return kinds.count(LayerKind.MLA), kinds.count(LayerKind.KDA)


def _allreduce(sc: Scenario, nbytes: float, curves: OpCurves | None) -> float:
    tp = sc.layout.tp
    if curves is None or tp <= 1 or tp > sc.system.scale_up_domain:
        return allreduce_time(nbytes, tp, sc.system, sc.comm)
    ring = 2 * (tp - 1) / tp * nbytes / sc.system.accelerator.scale_up_bw
    return ring / curves.allreduce(tp, nbytes)


def _communication(sc: Scenario, tokens_per_group: float, assignments_per_rank: float, imbalance: float, curves: OpCurves | None) -> float:
    config, layout = sc.config, sc.layout
    tokens_per_rank = tokens_per_group / layout.tp  # each TP rank dispatches its slice of the group's tokens
    a2a = a2a_layer_time(config, sc.quant, layout.ep_size, sc.system, sc.comm, tokens_per_rank, imbalance).total_s
    fetch = 0.0
    if layout.balance == Balance.MOONEP:
        n = moonep_prefetch_experts(config, layout, assignments_per_rank, sc.balance)
        fetch = prefetch_time(n, expert_bytes(config, sc.quant), layout.ep_size, sc.system, sc.comm)
    ar = _allreduce(sc, tokens_per_group * config.hidden_size * 2, curves)
    return num_moe_layers(config) * (a2a + fetch) + 2 * config.num_hidden_layers * ar


def _step(sc: Scenario, tokens_per_group: float, kv_len: float, decode: bool, prompts: int = 1, mean_keys: float | None = None) -> StepTime:
    """One forward step of `tokens_per_group` tokens per attention-DP group attending to `kv_len` cached tokens each.
    Prefill: the tokens belong to `prompts` sequences, and each query attends to `mean_keys` keys on average (default:
    kv_len plus the causal half of its own prompt's chunk). A decode step's kernels run at the CUDA-graph batch that
    holds its sequences (the padding is work; the throughput counts only the real sequences)."""
    config, quant, layout, acc = sc.config, sc.quant, sc.layout, sc.system.accelerator
    tp, eff = layout.tp, sc.efficiency
    curves = eff.curves(acc.name)
    real_seqs = tokens_per_group if decode else float(prompts)
    if decode:
        tokens_per_group = eff.overheads.padded_batch(tokens_per_group)
    spec = cache_spec(config, quant)
    n_mla, n_kda = _layer_counts(config)
    moe_layers = num_moe_layers(config)
    k = config.moe.num_experts_per_token
    seqs = tokens_per_group if decode else float(prompts)

    w = weight_bytes(config, quant)
    trunk_read = trunk_bytes_per_rank(config, quant, tp) - w.embedding_params * quant.trunk_bits / 8 / tp  # embedding rows are gathered, not streamed
    trunk_eff = curves.gemm(quant.trunk_compute, tokens_per_group) if curves else None
    trunk = _component("trunk", trunk_read, 2 * _trunk_active_params(config) * tokens_per_group / tp, acc.flops(quant.trunk_compute), eff.gemm, sc, trunk_eff)

    total_tokens = tokens_per_group * layout.dp
    replicas = layout.num_accelerators // layout.ep_size
    assignments_per_rank = total_tokens * k / layout.num_accelerators
    imbalance = rank_imbalance(config, layout, assignments_per_rank, sc.balance)
    tokens_per_replica = total_tokens / replicas
    p_hit = 1 - (1 - k / config.moe.num_experts) ** tokens_per_replica
    slots = experts_per_rank(config, layout)
    experts_hit = slots * min(1.0, p_hit * imbalance)
    expert_read = moe_layers * experts_hit * expert_bytes(config, quant)
    expert_flops = moe_layers * 2 * config.routed_expert_params() * assignments_per_rank * imbalance
    moe_eff = curves.moe(quant.expert_compute, assignments_per_rank * imbalance / max(experts_hit, 1e-9)) if curves else None
    experts = _component("experts", expert_read, expert_flops, acc.flops(quant.expert_compute), eff.gemm, sc, moe_eff)

    attn = attention_shape(config)
    attn_curves = curves if attn.kind == "mla" else None  # the shipped attention curves are MLA kernels; GQA stays flat
    heads = attn.num_heads / tp
    cache_per_token = spec.mla.bytes_per_token / attn.kv_split(tp)  # GQA splits its KV heads over TP; an MLA latent does not
    if decode:  # absorbed MLA: scores over the 576-wide latent, values over the 512-wide part; GQA: qk + v head widths
        mla_flops = n_mla * tokens_per_group * 2 * heads * kv_len * attn.decode_width
        mla_bytes = seqs * kv_len * cache_per_token
        attn_eff = attn_curves.attention_decode(seqs * kv_len) if attn_curves else None
    else:  # naive attention over the chunk: the cached keys plus, causally, the average query's half of its own chunk
        keys = kv_len + (tokens_per_group / prompts + 1) / 2 if mean_keys is None else mean_keys
        mla_flops = n_mla * tokens_per_group * 2 * heads * keys * attn.prefill_width
        mla_bytes = (seqs * kv_len + tokens_per_group) * cache_per_token
        attn_eff = attn_curves.attention_prefill(kv_len + tokens_per_group / prompts) if attn_curves else None
    mla = _component(attn.component, mla_bytes, mla_flops, acc.flops(quant.attention_compute), eff.attention, sc, attn_eff)

    kda_state = seqs * 2 * spec.kda.bytes_per_sequence / tp  # read and written back every step
    hkv = config.kda.num_heads / tp * config.kda.head_dim * config.kda.head_dim
    kda_flops = n_kda * tokens_per_group * KDA_FLOPS_PER_STATE_ELEMENT * hkv
    if not decode:
        kda_flops += n_kda * tokens_per_group * 2 * KDA_CHUNK * config.kda.num_heads / tp * 2 * config.kda.head_dim
    kda = _component("kda", kda_state, kda_flops, acc.flops("bf16"), eff.attention, sc)

    # each sublayer's AttnRes mixer reads the token's block summaries
    attn_res_bytes = tokens_per_group / tp * 2 * config.num_hidden_layers * attn_res_slots(config) * config.hidden_size * 2
    attn_res = _component("attn_res", attn_res_bytes, 0.0, acc.flops("bf16"), eff.gemm, sc)

    comm = _communication(sc, tokens_per_group, assignments_per_rank, imbalance, curves)
    components = tuple(c for c in (trunk, experts, mla, kda, attn_res) if c.bytes or c.flops)
    local = sum(c.time_s for c in components)
    overlap = eff.comm_overlap if tokens_per_group >= 2 else 0.0  # two-batch overlap needs two micro-batches
    exposed = comm - overlap * min(comm, local)
    return StepTime(components, comm, exposed, imbalance, real_seqs if decode else tokens_per_group, eff.overheads.host_gap(real_seqs))


def decode_step(sc: Scenario) -> StepTime:
    seqs_per_group = sc.workload.concurrency / sc.layout.dp
    return _step(sc, seqs_per_group, float(sc.workload.context), decode=True)


def prefill_step(sc: Scenario, kv_len: float | None = None, mean_keys: float | None = None) -> StepTime:
    """One chunk of one prompt per group at `kv_len` already-cached tokens. Default: the middle chunk, (prompt - chunk) / 2,
    whose queries see (prompt + 1) / 2 keys on average -- the mean over the whole prompt, so chunks x this step is the
    prompt's attention work exactly. `mean_keys` overrides the keys each query attends to."""
    prompt = sc.workload.prompt_tokens
    chunk = min(sc.workload.prefill_chunk, prompt)
    return _step(sc, float(chunk), (prompt - chunk) / 2 if kv_len is None else kv_len, decode=False, mean_keys=mean_keys)


def prefill_batch_step(sc: Scenario) -> StepTime:
    """A throughput prefill step: as many whole prompts as one chunk holds (at least one prompt's chunk)."""
    prompt = sc.workload.prompt_tokens
    if prompt >= sc.workload.prefill_chunk:
        return prefill_step(sc)
    prompts = sc.workload.prefill_chunk // prompt
    return _step(sc, float(prompts * prompt), 0.0, decode=False, prompts=prompts)


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

    @property
    def per_accelerator_tok_s(self) -> float:
        return self.throughput_tok_s / self.num_accelerators


def evaluate(sc: Scenario, memory_limited: bool = False) -> Metrics:
    n = sc.layout.num_accelerators
    memory = working_set(sc.config, sc.quant, sc.layout, sc.workload, sc.system, sc.fill)
    dec = decode_step(sc)
    pre = prefill_step(sc)
    batch = prefill_batch_step(sc)
    chunk = min(sc.workload.prefill_chunk, sc.workload.prompt_tokens)
    chunks = -(-sc.workload.prompt_tokens // chunk)
    throughput = sc.workload.concurrency / dec.total_s if sc.workload.concurrency else 0.0
    prefill_tok_s = batch.tokens_per_group * sc.layout.dp / batch.total_s
    usd_per_s = sc.system.price_per_hour * n / 3600
    tdp, wall = sc.system.accelerator.tdp_w, sc.system.power_w
    decode_w, prefill_w = step_power_w(dec, tdp, wall, sc.power), step_power_w(batch, tdp, wall, sc.power)
    return Metrics(
        memory=memory,
        decode=dec,
        prefill=pre,
        throughput_tok_s=throughput,
        per_user_tok_s=1 / dec.total_s,
        ttft_s=chunks * pre.total_s,
        prefill_tok_s=prefill_tok_s,
        tokens_per_joule=throughput / (n * decode_w),
        prefill_tokens_per_joule=prefill_tok_s / (n * prefill_w),
        decode_power_w=decode_w,
        prefill_power_w=prefill_w,
        usd_per_m_output=usd_per_s / throughput * 1e6 if throughput else float("inf"),
        usd_per_m_input=usd_per_s / prefill_tok_s * 1e6,
        binding=binding(dec, memory, memory_limited),
        num_accelerators=n,
    )
