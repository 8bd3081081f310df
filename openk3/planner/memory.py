"""Working set per accelerator: weights, hybrid cache, workspace, communication buffers.

Every byte count comes from the config (`param_count` and friends) and the engine's own cache byte specs
(`CacheSpec`), so the planner cannot drift from what the engine allocates. Capacity is the visible HBM times a fill
fraction (default 0.9: allocator fragmentation, CUDA context and graphs live in the rest).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from openk3.config import ModelConfig
from openk3.config.tensor_parallel import tensor_parallel_split_params
from openk3.planner.attention import attention_shape, attention_tp_problem, gqa_of
from openk3.planner.hardware import System
from openk3.planner.inputs import Balance, Layout, Quantisation, Workload
from openk3.planner.placement import tp_placement_problem
from openk3.serve.cache.spec import CacheSpec, MLAPageSpec

DEFAULT_FILL = 0.9
PAGE_SIZE = 64  # only names the page; the planner counts cache bytes token-exact
EXPERT_TENSORS = 3  # w1, w3, w2 of one routed expert


@dataclass(frozen=True)
class WeightBytes:
    routed_params: int
    trunk_params: int  # everything that is not a routed expert: attention, shared experts, dense MLP, norms, embeddings
    embedding_params: int
    routed_bytes: float
    trunk_bytes: float

    @property
    def checkpoint_bytes(self) -> float:
        return self.routed_bytes + self.trunk_bytes


@functools.lru_cache(maxsize=64)
def num_moe_layers(config: ModelConfig) -> int:
    return sum(1 for i in range(config.num_hidden_layers) if config.is_moe_layer(i))


@functools.lru_cache(maxsize=64)  # configs are frozen; the search asks the same question thousands of times
def weight_bytes(config: ModelConfig, quant: Quantisation) -> WeightBytes:
    routed = num_moe_layers(config) * config.moe.num_experts * config.routed_expert_params()
    total = config.param_count().total
    trunk = total - routed
    return WeightBytes(
        routed_params=routed,
        trunk_params=trunk,
        embedding_params=config.vocab_size * config.hidden_size,
        routed_bytes=routed * quant.expert_bits / 8 + num_moe_layers(config) * config.moe.num_experts * EXPERT_TENSORS * quant.expert_tensor_scale_bytes,
        trunk_bytes=trunk * quant.trunk_bits / 8,
    )


def expert_bytes(config: ModelConfig, quant: Quantisation) -> float:
    """One routed expert of one layer (w1, w3, w2), with any per-tensor scales (NVFP4)."""
    return config.routed_expert_params() * quant.expert_bits / 8 + EXPERT_TENSORS * quant.expert_tensor_scale_bytes


def trunk_bytes_per_rank(config: ModelConfig, quant: Quantisation, tp: int) -> float:
    """Trunk bytes one TP rank holds: the part tensor parallelism splits over tp ranks plus the part every rank keeps whole
    (norms, router, latent MoE projections, MLA's q_a/kv_a, KDA's f_a/g_a: config/tensor_parallel.py, which a runtime test
    checks against openk3's own TP cut). A GQA model's trunk is treated as split whole (its small replicated part is not
    counted)."""
    w = weight_bytes(config, quant)
    if tp == 1 or gqa_of(config) is not None:
        return w.trunk_bytes / tp
    split = tensor_parallel_split_params(config)
    return w.trunk_bytes * (w.trunk_params - split + split / tp) / w.trunk_params


def experts_per_rank(config: ModelConfig, layout: Layout) -> int:
    """Slots on the fullest rank: logical experts plus redundant replicas, spread over ep ranks."""
    return math.ceil((config.moe.num_experts + layout.redundant_experts) / layout.ep_size)


@functools.lru_cache(maxsize=64)
def cache_spec(config: ModelConfig, quant: Quantisation) -> CacheSpec:
    """The engine's spec, with the KDA state in `quant.state_dtype_bytes`; for a GQA model the per-token page entry is
    K and V of every KV head (the engine's spec names it MLA: one entry per full-attention layer per token). An fp8 cache
    of an MLA model is the engine's FP8 latent cache: e4m3 values with their scales (config/cache_format.py), the conv
    windows kept in bf16."""
    fp8_latent = quant.cache_dtype_bytes == 1 and gqa_of(config) is None
    dtype_bytes = 2 if fp8_latent else quant.cache_dtype_bytes
    spec = CacheSpec.from_config(config, page_size=PAGE_SIZE, cache_dtype_bytes=dtype_bytes, fp8_latent=fp8_latent)
    kda = replace(spec.kda, state_dtype_bytes=quant.state_dtype_bytes)
    if gqa_of(config) is None:
        return replace(spec, kda=kda)
    shape = attention_shape(config)
    mla = MLAPageSpec(num_layers=shape.num_layers, latent_dim=shape.cache_values_per_token_per_layer, page_size=PAGE_SIZE, dtype_bytes=quant.cache_dtype_bytes)
    return CacheSpec(mla=mla, kda=kda)


def attn_res_slots(config: ModelConfig) -> int:
    """Block summaries a token carries through the stack: one per completed block plus the running one."""
    if config.attn_res_block_size is None:
        return 0
    return math.ceil(config.num_hidden_layers / config.attn_res_block_size) + 1


def workspace_bytes_per_token(config: ModelConfig, layout: Layout) -> float:
    """Live activations of one token in flight on one rank (estimate, bf16): residual stream and AttnRes block
    summaries, the widest MLP intermediate, fp32 logits. Exact kernels differ; this is small next to the cache."""
    hidden = config.hidden_size * (attn_res_slots(config) + 8)
    mlp = 2 * max(config.intermediate_size, config.moe.moe_intermediate_size * max(config.moe.num_shared_experts, 1)) / layout.tp
    return 2 * (hidden + mlp) + 4 * config.vocab_size / layout.tp


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on the fullest accelerator."""

    routed_experts: float
    trunk: float
    mla_cache: float
    kda_state: float
    workspace: float
    comm_buffers: float
    prefetch_buffers: float
    capacity: float
    seqs_per_group: int

    @property
    def weights(self) -> float:
        return self.routed_experts + self.trunk

    @property
    def cache(self) -> float:
        return self.mla_cache + self.kda_state

    @property
    def total(self) -> float:
        return self.weights + self.cache + self.workspace + self.comm_buffers + self.prefetch_buffers

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def as_dict(self) -> dict[str, float]:
        keys = ("routed_experts", "trunk", "mla_cache", "kda_state", "workspace", "comm_buffers", "prefetch_buffers")
        return {k: getattr(self, k) for k in keys} | {"total": self.total, "capacity": self.capacity}


def _fixed_bytes(config: ModelConfig, quant: Quantisation, layout: Layout) -> tuple[float, float, float]:
    routed = num_moe_layers(config) * experts_per_rank(config, layout) * expert_bytes(config, quant)
    trunk = trunk_bytes_per_rank(config, quant, layout.tp)
    prefetch = 0.0
    if layout.balance == Balance.MOONEP:
        # up to E/R remote experts per rank for one layer, double-buffered so layer l+1 loads while l computes
        prefetch = 2 * math.ceil(config.moe.num_experts / layout.ep_size) * expert_bytes(config, quant)
    return routed, trunk, prefetch


def _per_sequence_bytes(config: ModelConfig, quant: Quantisation, layout: Layout, context: int, state_copies: int = 1) -> tuple[float, float, float, float]:
    """(mla, kda, workspace, comm) bytes one more sequence in a DP group adds to each of the group's ranks; `state_copies`
    KDA states per sequence (k + 1 under speculative decoding: the verification's per-position states)."""
    spec = cache_spec(config, quant)
    mla = context * spec.mla.bytes_per_token / attention_shape(config).kv_split(layout.tp)  # an MLA latent is replicated on each TP rank
    kda = state_copies * spec.kda.bytes_per_sequence / layout.tp  # the state splits by head
    ws = workspace_bytes_per_token(config, layout)
    per_token_a2a = config.moe.num_experts_per_token * (a2a_width(config) * (quant.dispatch_bits + quant.combine_bits) / 8)
    comm = 2 * per_token_a2a / layout.tp  # send + receive staging; each TP rank dispatches 1/tp of its group's tokens
    return mla, kda, ws, comm


def a2a_width(config: ModelConfig) -> int:
    """Values per token that cross the EP fabric: the latent width when experts run in a latent space."""
    return config.moe.latent_size or config.hidden_size


def working_set(
    config: ModelConfig, quant: Quantisation, layout: Layout, workload: Workload, system: System, fill: float = DEFAULT_FILL, state_copies: int = 1
) -> MemoryBreakdown:
    if not 0 < fill <= 1:
        raise ValueError(f"fill={fill!r} is invalid: expected a fraction of HBM in (0, 1]")
    routed, trunk, prefetch = _fixed_bytes(config, quant, layout)
    seqs = math.ceil(workload.concurrency / layout.dp)
    mla, kda, ws, comm = _per_sequence_bytes(config, quant, layout, workload.context, state_copies)
    return MemoryBreakdown(
        routed_experts=routed,
        trunk=trunk,
        mla_cache=seqs * mla,
        kda_state=seqs * kda,
        workspace=seqs * ws,
        comm_buffers=seqs * comm,
        prefetch_buffers=prefetch,
        capacity=system.accelerator.usable_hbm * fill,
        seqs_per_group=seqs,
    )


def max_concurrency(
    config: ModelConfig, quant: Quantisation, layout: Layout, context: int, system: System, fill: float = DEFAULT_FILL, state_copies: int = 1
) -> int:
    """Most sequences of `context` tokens the instance holds in HBM at once (0 when the weights alone do not fit)."""
    routed, trunk, prefetch = _fixed_bytes(config, quant, layout)
    free = system.accelerator.usable_hbm * fill - routed - trunk - prefetch
    if free <= 0:
        return 0
    per_seq = sum(_per_sequence_bytes(config, quant, layout, context, state_copies))
    return int(free // per_seq) * layout.dp


def max_concurrency_after_weights(
    config: ModelConfig, quant: Quantisation, layout: Layout, context: int, system: System, fraction: float, step_tokens: int
) -> int:
    """Most sequences of `context` tokens whose cache fits in `fraction` of the memory left after the weights and the
    activations of one step of `step_tokens` tokens per rank: how TensorRT-LLM's PyTorch runtime sizes its KV cache
    (`kv_cache_free_gpu_mem_fraction`; tensorrt_llm/_torch/pyexecutor/_util.py: available KV memory = (device memory -
    the peak of a dry run at max_num_tokens, weights included) x fraction), where `max_concurrency` fills a fraction
    of the whole HBM. The CUDA context and the graphs' pools are not counted (the catalogue's usable HBM stands for the
    device memory)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction!r} is invalid: expected a fraction of the free memory in (0, 1]")
    if step_tokens < 1:
        raise ValueError(f"step_tokens={step_tokens!r} is invalid: expected >= 1 token per step")
    routed, trunk, prefetch = _fixed_bytes(config, quant, layout)
    mla, kda, ws, comm = _per_sequence_bytes(config, quant, layout, context)
    free = system.accelerator.usable_hbm - routed - trunk - prefetch - step_tokens * (ws + comm)
    if free <= 0:
        return 0
    return int(fraction * free // (mla + kda)) * layout.dp


def tp_problem(config: ModelConfig, tp: int) -> str | None:
    """Why `tp` cannot shard this model's attention (None when it can): TP splits MLA (or GQA) and KDA heads."""
    return attention_tp_problem(config, tp)


def candidate_tps(num_accelerators: int, system: System, max_tp: int = 16, config: ModelConfig | None = None) -> list[int]:
    """TP sizes whose groups divide the instance and sit whole inside one scale-up domain (TP all-reduces every layer;
    `placement.py`) and, given the config, divide its attention heads."""
    limit = min(system.scale_up_domain, max_tp, num_accelerators)
    tps = [t for t in range(1, limit + 1) if tp_placement_problem(t, num_accelerators, system) is None]
    return [t for t in tps if config is None or tp_problem(config, t) is None]


def min_accelerators(
    config: ModelConfig,
    quant: Quantisation,
    workload: Workload,
    system: System,
    balance: Balance = Balance.EPLB,
    fill: float = DEFAULT_FILL,
    limit: int = 4096,
) -> Layout | None:
    """The smallest instance (and its TP) whose fullest rank holds the weights and the workload's cache."""
    for n in range(1, limit + 1):
        for tp in candidate_tps(n, system, config=config):
            layout = Layout(num_accelerators=n, tp=tp, balance=balance)
            if working_set(config, quant, layout, workload, system, fill).fits:
                return layout
    return None
