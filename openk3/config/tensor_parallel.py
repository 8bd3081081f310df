"""Parameters tensor parallelism splits, counted from the config alone (the planner's per-rank trunk bytes; the runtime's
cut is openk3.parallel.tp, and a test checks the two agree tensor for tensor on the meta device).

Split over T ranks: KDA and MLA heads (every per-head projection, conv channel and gate parameter, and o_proj's input),
the dense MLP and the shared experts by intermediate width, the embedding and the LM head by vocabulary rows. Everything
else of the trunk is replicated on every rank: norms, the router, the latent MoE projections, MLA's q_a / kv_a latent
projections, KDA's low-rank f_a / g_a, the AttnRes mixers. Routed experts are not trunk (expert parallelism or a width
split handles them).
"""

from __future__ import annotations

from openk3.config.model import LayerKind, ModelConfig


def tensor_parallel_split_params(config: ModelConfig) -> int:
    """Trunk parameters that tensor parallelism divides by T (the rest of the trunk is replicated)."""
    d = config.hidden_size
    kda, mla, moe = config.kda, config.mla, config.moe
    h, k, p = kda.num_heads, kda.head_dim, kda.proj_dim
    per_kda = 3 * d * p + 3 * p * kda.conv_kernel + k * p + h + p + d * h + (d * p if kda.full_rank_output_gate else k * p) + p * d
    q_in = mla.q_lora_rank if mla.q_lora_rank is not None else d
    heads = mla.num_heads
    per_mla = q_in * heads * mla.qk_head_dim + mla.kv_lora_rank * heads * (mla.qk_nope_head_dim + mla.v_head_dim) + heads * mla.v_head_dim * d
    if mla.output_gate:
        per_mla += d * heads * mla.v_head_dim
    total = sum(per_kda if kind == LayerKind.KDA else per_mla for kind in config.layer_kinds)
    for i in range(config.num_hidden_layers):
        width = moe.moe_intermediate_size * moe.num_shared_experts if config.is_moe_layer(i) else config.intermediate_size
        total += 3 * d * width
    vocab_tables = 1 if config.tie_word_embeddings else 2
    return total + vocab_tables * config.vocab_size * d
