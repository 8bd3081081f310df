"""Step time of the busiest rank, decode and prefill, and what it costs.

Each component (trunk GEMMs, routed experts, MLA attention, KDA recurrence, AttnRes) takes
max(bytes / (HBM BW x eff_hbm), FLOPs / (peak x eff)) on its own; components run one after another, so their times
add. Communication per MoE layer (dispatch + combine on the busiest rank, MoonEP weight prefetch) and TP all-reduces
add too, except the `comm_overlap` fraction hidden under compute (two-batch overlap, which needs two micro-batches: with
fewer than two sequences per group nothing is hidden, nor under an all-gather / reduce-scatter exchange,
`comm.Exchange.ALLGATHER`). TP all-reduces run over NVLink inside the scale-up domain and over the NIC when TP spans
domains. The KDA state is read and written every decode step, which is what makes it cost HBM
bandwidth and not only capacity.

Prefill: a chunk of `prefill_chunk` tokens at `kv_len` cached tokens; causal attention, so its queries see kv_len plus
(chunk + 1) / 2 keys on average. TTFT is one prompt's chunks run alone (service time); prefill throughput, $ per input
token and prefill energy come from steps that pack as many whole prompts as a chunk holds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from openk3.config import LayerKind, ModelConfig
from openk3.planner.attention import attention_shape
from openk3.planner.balance import BalanceParams, moonep_prefetch_experts, rank_imbalance
from openk3.planner.comm import CommParams, Exchange, a2a_layer_time, allgather_layer_time, allreduce_time, moe_chunks, prefetch_time
from openk3.planner.efficiency import Efficiency
from openk3.planner.energy import PowerParams, step_power_w
from openk3.planner.hardware import System
from openk3.planner.inputs import Balance, Layout, Quantisation, Workload
from openk3.planner.memory import (
    DEFAULT_FILL,
    attn_res_slots,
    cache_spec,
    expert_bytes,
    experts_per_rank,
    num_moe_layers,
    trunk_bytes_per_rank,
    weight_bytes,
    working_set,
)
from openk3.planner.op_efficiency import OpCurves
from openk3.planner.speculative import SpecDecoding, SpecStep
from openk3.planner.steps import Component, Metrics, PrefillChunk, StepTime, VerifyShape, binding

KDA_FLOPS_PER_STATE_ELEMENT = 6  # decay, k^T v outer product, q S readout: ~3 multiply-adds per state element per token
KDA_CHUNK = 64


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
    spec: SpecDecoding | None = None  # speculative decoding (speculative.py); None: one token per decode step

    def with_(self, **changes: object) -> Scenario:
        return replace(self, **changes)  # type: ignore[arg-type]


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
    if sc.comm.exchange == Exchange.ALLGATHER:
        a2a = allgather_layer_time(config, sc.quant, layout.ep_size, sc.system, sc.comm, tokens_per_rank).total_s
    else:
        a2a = a2a_layer_time(config, sc.quant, layout.ep_size, sc.system, sc.comm, tokens_per_rank, imbalance).total_s
    fetch = 0.0
    if layout.balance == Balance.MOONEP:
        n = moonep_prefetch_experts(config, layout, assignments_per_rank, sc.balance)
        fetch = prefetch_time(n, expert_bytes(config, sc.quant), layout.ep_size, sc.system, sc.comm)
    ar = _allreduce(sc, tokens_per_group * config.hidden_size * 2, curves)
    return num_moe_layers(config) * (a2a + fetch) + 2 * config.num_hidden_layers * ar


def _step(
    sc: Scenario,
    tokens_per_group: float,
    kv_len: float,
    decode: bool,
    prompts: int = 1,
    mean_keys: float | None = None,
    verify: VerifyShape | None = None,
    chunk: PrefillChunk | None = None,
) -> StepTime:
    """One forward step of `tokens_per_group` tokens per attention-DP group attending to `kv_len` cached tokens each.
    Prefill: the tokens belong to `prompts` sequences, and each query attends to `mean_keys` keys on average (default:
    kv_len plus the causal half of its own prompt's chunk). Decode: `tokens_per_group` sequences, one query each, or
    `verify.queries` each for a speculative verify step (which also snapshots and may restore the KDA state). A decode
    step's kernels run at the CUDA-graph batch that holds its sequences (the padding is work; the throughput counts only
    the real sequences). A decode step may carry a prefill `chunk` (chunked prefill mixed with decode): its tokens join
    the decode rows in every GEMM, expert and collective (the weights are read once for both), its attention is a second
    kernel beside the decode one, and the step runs eager at its real batch (captured graphs hold decode-only batches)."""
    config, quant, layout, acc = sc.config, sc.quant, sc.layout, sc.system.accelerator
    tp, eff = layout.tp, sc.efficiency
    curves = eff.curves(acc.name)
    real_seqs = tokens_per_group if decode else float(prompts)
    seqs = eff.step_overheads.padded_batch(tokens_per_group) if decode and chunk is None else real_seqs
    if decode:
        tokens_per_group = seqs * (verify.queries if verify else 1)
    extra = chunk.tokens if chunk else 0.0
    linear_tokens = tokens_per_group + extra
    spec = cache_spec(config, quant)
    n_mla, n_kda = _layer_counts(config)
    moe_layers = num_moe_layers(config)
    k = config.moe.num_experts_per_token

    w = weight_bytes(config, quant)
    trunk_read = trunk_bytes_per_rank(config, quant, tp) - w.embedding_params * quant.trunk_bits / 8 / tp  # embedding rows are gathered, not streamed
    trunk_eff = curves.gemm(quant.trunk_compute, linear_tokens) if curves else None
    trunk = _component("trunk", trunk_read, 2 * _trunk_active_params(config) * linear_tokens / tp, acc.flops(quant.trunk_compute), eff.gemm, sc, trunk_eff)

    total_tokens = linear_tokens * layout.dp
    replicas = layout.num_accelerators // layout.ep_size
    assignments_per_rank = total_tokens * k / layout.num_accelerators
    imbalance = rank_imbalance(config, layout, assignments_per_rank, sc.balance)
    tokens_per_replica = total_tokens / replicas
    p_hit = 1 - (1 - k / config.moe.num_experts) ** tokens_per_replica
    slots = experts_per_rank(config, layout)
    experts_hit = slots * min(1.0, p_hit * imbalance)
    chunks = moe_chunks(sc.comm, total_tokens)  # each chunk of the gathered tokens reads the experts' weights again
    expert_read = chunks * moe_layers * experts_hit * expert_bytes(config, quant)
    expert_flops = moe_layers * 2 * config.routed_expert_params() * assignments_per_rank * imbalance
    moe_eff = curves.moe(quant.expert_compute, assignments_per_rank * imbalance / chunks / max(experts_hit, 1e-9)) if curves else None
    experts = _component("experts", expert_read, expert_flops, acc.flops(quant.expert_compute), eff.gemm, sc, moe_eff)

    attn = attention_shape(config)
    is_mla = attn.kind == "mla"
    heads = attn.num_heads / tp
    cache_per_token = spec.mla.bytes_per_token / attn.kv_split(tp)  # GQA splits its KV heads over TP; an MLA latent does not
    attn_peak = acc.flops(quant.attention_compute)
    decode_peak = attn_peak
    if decode:  # absorbed MLA: scores over the 576-wide latent, values over the 512-wide part; GQA: qk + v head widths
        mla_flops = n_mla * tokens_per_group * 2 * heads * kv_len * attn.decode_width
        mla_bytes = seqs * kv_len * cache_per_token
        fp8_cache = is_mla and quant.cache_dtype_bytes == 1 and curves is not None and curves.fp8_cache_grid
        if fp8_cache:  # the FP8-cache MLA kernel multiplies in FP8 (op_efficiency.py): its curve is against that peak
            decode_peak = acc.flops("fp8")
        attn_eff = curves.attention_decode(heads, seqs, kv_len, is_mla, fp8_cache=fp8_cache) if curves else None
    else:  # naive attention over the chunk: the cached keys plus, causally, the average query's half of its own chunk
        keys = kv_len + (tokens_per_group / prompts + 1) / 2 if mean_keys is None else mean_keys
        mla_flops = n_mla * tokens_per_group * 2 * heads * keys * attn.prefill_width
        mla_bytes = (seqs * kv_len + tokens_per_group) * cache_per_token
        attn_eff = curves.attention_prefill(kv_len + tokens_per_group / prompts, is_mla) if curves else None
    mla = _component(attn.component, mla_bytes, mla_flops, decode_peak, eff.attention, sc, attn_eff)
    chunk_attn = None
    if chunk:  # the prompts' own attention: the prefix each has cached plus the causal half of its chunk
        prefix = max(0.0, chunk.mean_keys - (chunk.tokens / chunk.prompts + 1) / 2)
        c_flops = n_mla * chunk.tokens * 2 * heads * chunk.mean_keys * attn.prefill_width
        c_eff = curves.attention_prefill(chunk.prompt_tokens, is_mla) if curves else None
        c_bytes = (chunk.prompts * prefix + chunk.tokens) * cache_per_token
        chunk_attn = _component(attn.component + "_prefill", c_bytes, c_flops, attn_peak, eff.attention, sc, c_eff)

    state_passes = 2 + (verify.state_passes if verify else 0)  # read and written back every step (+ per-position states, copy)
    kda_state = (seqs * state_passes + (2 * chunk.prompts if chunk else 0.0)) * spec.kda.bytes_per_sequence / tp
    hkv = config.kda.num_heads / tp * config.kda.head_dim * config.kda.head_dim
    kda_flops = n_kda * (linear_tokens + (seqs * verify.recompute_tokens if verify else 0.0)) * KDA_FLOPS_PER_STATE_ELEMENT * hkv
    chunked = extra if decode else tokens_per_group  # tokens run through KDA's chunked (prefill) form
    kda_flops += n_kda * chunked * 2 * KDA_CHUNK * config.kda.num_heads / tp * 2 * config.kda.head_dim
    kda = _component("kda", kda_state, kda_flops, acc.flops("bf16"), eff.attention, sc)

    # each sublayer's AttnRes mixer reads the token's block summaries
    attn_res_bytes = linear_tokens / tp * 2 * config.num_hidden_layers * attn_res_slots(config) * config.hidden_size * 2
    attn_res = _component("attn_res", attn_res_bytes, 0.0, acc.flops("bf16"), eff.gemm, sc)

    comm = _communication(sc, linear_tokens, assignments_per_rank, imbalance, curves)
    components = tuple(c for c in (trunk, experts, mla, chunk_attn, kda, attn_res) if c is not None and (c.bytes or c.flops))
    local = sum(c.time_s for c in components)
    overlap = (  # two-batch overlap needs two micro-batches (of sequences, when decoding), and an exchange that allows it
        eff.comm_overlap if (real_seqs if decode else tokens_per_group) >= 2 and sc.comm.exchange == Exchange.ALL_TO_ALL else 0.0
    )
    exposed = comm - overlap * min(comm, local)
    host_seqs = real_seqs + (chunk.prompts if chunk else 0.0)
    overhead = eff.step_overheads.host_gap(host_seqs)
    if chunk is not None:  # a mixed step runs eager: captured graphs hold decode-only batches
        overhead += eff.step_overheads.eager_s_per_layer * config.num_hidden_layers
    return StepTime(components, comm, exposed, imbalance, real_seqs if decode else tokens_per_group, overhead)


def decode_step(sc: Scenario) -> StepTime:
    seqs_per_group = sc.workload.concurrency / sc.layout.dp
    return _step(sc, seqs_per_group, float(sc.workload.context), decode=True)


def batch_step(sc: Scenario, decode_seqs: float, chunk: PrefillChunk | None = None) -> StepTime:
    """A step of `decode_seqs` decoding sequences per group (at the workload's context), carrying a prefill `chunk` (a
    mixed step, continuous.py) or not (a decode step at that batch)."""
    return _step(sc, decode_seqs, float(sc.workload.context), decode=True, chunk=chunk)


def speculative_step(sc: Scenario) -> SpecStep | None:
    """One speculative iteration (speculative.py) at the workload's batch: k draft forwards, each the draft's share of a
    decode step (`draft_layers` / layers of its kernels and communication), then the verify step over k + 1 positions."""
    spec = sc.spec
    if spec is None:
        return None
    seqs = sc.workload.concurrency / sc.layout.dp
    # the per-position states written (k), and the kept one copied into the slot after a rejection (speculative.py)
    shape = VerifyShape(queries=spec.tokens + 1, state_passes=spec.tokens + 2 * spec.p_reject, recompute_tokens=0.0)
    verify = _step(sc, seqs, float(sc.workload.context), decode=True, verify=shape)
    plain = _step(sc, seqs, float(sc.workload.context), decode=True)
    draft = spec.tokens * spec.draft_layers / sc.config.num_hidden_layers * (plain.local_s + plain.exposed_comm_s)
    snapshot = seqs * spec.tokens * cache_spec(sc.config, sc.quant).kda.bytes_per_sequence / sc.layout.tp
    return SpecStep(verify_s=verify.total_s, draft_s=draft, tokens_per_iteration=spec.tokens_per_iteration, snapshot_bytes=snapshot)


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


def evaluate(sc: Scenario, memory_limited: bool = False) -> Metrics:
    n = sc.layout.num_accelerators
    memory = working_set(sc.config, sc.quant, sc.layout, sc.workload, sc.system, sc.fill, state_copies=sc.spec.state_copies if sc.spec else 1)
    dec = decode_step(sc)
    spec = speculative_step(sc)
    pre = prefill_step(sc)
    batch = prefill_batch_step(sc)
    chunk = min(sc.workload.prefill_chunk, sc.workload.prompt_tokens)
    chunks = -(-sc.workload.prompt_tokens // chunk)
    token_s = spec.per_token_s if spec else dec.total_s  # wall time per output token of one sequence
    throughput = sc.workload.concurrency / token_s if sc.workload.concurrency else 0.0
    prefill_tok_s = batch.tokens_per_group * sc.layout.dp / batch.total_s
    usd_per_s = sc.system.price_per_hour * n / 3600
    tdp, wall = sc.system.accelerator.tdp_w, sc.system.power_w
    decode_w, prefill_w = step_power_w(dec, tdp, wall, sc.power), step_power_w(batch, tdp, wall, sc.power)
    return Metrics(
        memory=memory,
        decode=dec,
        prefill=pre,
        throughput_tok_s=throughput,
        per_user_tok_s=1 / token_s,
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
        spec=spec,
    )
