"""Which config.json keys the planner reads, which it ignores on purpose (and why), per model family.

A key in neither list is an error that names it: a config the planner half-understands would give a plan that is
silently wrong (a sliding window it did not see, a dense layer it did not count). Ignored keys change values, not the
bytes or FLOPs the planner counts, or describe something it says it does not model (docs/planner.md lists them).
"""

from __future__ import annotations

from typing import Any

# keys every family may carry that change no byte or FLOP the planner counts
COMMON_IGNORED: dict[str, str] = {
    "architectures": "class names; the family comes from model_type",
    "auto_map": "remote-code class names",
    "transformers_version": "writer's version",
    "_name_or_path": "names the plan",
    "torch_dtype": "the checkpoint dtype; the planner's formats come from quantization_config and the --*-dtype flags",
    "dtype": "as torch_dtype",
    "bos_token_id": "tokenizer id",
    "eos_token_id": "tokenizer id",
    "pad_token_id": "tokenizer id",
    "initializer_range": "training only",
    "attention_dropout": "training only",
    "use_cache": "runtime flag",
    "pretraining_tp": "training-time tensor parallelism",
    "ep_size": "training-time expert parallelism",
    "rope_theta": "position encoding: changes values, not bytes or FLOPs",
    "rope_scaling": "position encoding (YaRN etc.): changes values, not bytes or FLOPs",
    "rms_norm_eps": "numerics",
    "routed_scaling_factor": "routing numerics",
    "norm_topk_prob": "routing numerics",
    "scoring_func": "routing numerics (softmax/sigmoid): the load model is BalanceParams",
    "topk_method": "routing numerics",
    "seq_aux": "training loss",
    "aux_loss_alpha": "training loss",
    "router_aux_loss_coef": "training loss",
    "output_router_logits": "training output",
    "num_nextn_predict_layers": "MTP layers: their weights are not counted (speculative decoding is priced by --spec-tokens)",
    "max_position_embeddings": "read: --context may not exceed it",
    "tie_word_embeddings": "read: a tied head stores no second vocab x hidden matrix",
    "quantization_config": "read: the default weight formats",
    "hidden_act": "read: only SiLU (SwiGLU) MLPs are priced",
}

MLA_MOE_READ = frozenset(
    {
        "model_type",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_routed_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "n_shared_experts",
        "intermediate_size",
        "first_k_dense_replace",
        "moe_layer_freq",
        "attention_bias",
    }
)
MLA_MOE_IGNORED: dict[str, str] = {
    "num_key_value_heads": "MLA caches one latent shared by all heads; a KV-head count does not apply",
    "n_group": "group-limited routing caps the nodes a token reaches; not modelled: experts are assumed spread over all ranks",
    "topk_group": "as n_group",
}

GQA_MOE_READ = frozenset(
    {
        "model_type",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "intermediate_size",
        "decoder_sparse_step",
        "mlp_only_layers",
        "attention_bias",
        "use_sliding_window",
    }
)
GQA_MOE_IGNORED: dict[str, str] = {
    "sliding_window": "only used with use_sliding_window (which must be false)",
    "max_window_layers": "only used with use_sliding_window (which must be false)",
}

# Kimi-Linear / K3: the keys openk3.config.hf.config_from_hf reads, and those its writer and Moonshot's configs add
KIMI_READ = frozenset(
    {
        "model_type",
        "text_config",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "moe_intermediate_size",
        "num_attention_heads",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "mla_use_output_gate",
        "num_experts",
        "num_local_experts",
        "n_routed_experts",
        "num_experts_per_token",
        "num_experts_per_tok",
        "num_shared_experts",
        "n_shared_experts",
        "first_k_dense_replace",
        "mlp_layer_types",
        "layer_types",
        "moe_layer_freq",
        "num_expert_group",
        "n_group",
        "moe_router_activation_func",
        "moe_renormalize",
        "routed_expert_hidden_size",
        "latent_moe_use_norm",
        "linear_attn_config",
        "linear_head_dim",
        "linear_num_heads",
        "linear_conv_kernel_dim",
        "attn_res_block_size",
        "activation_situ_beta",
        "situ_beta",
        "activation_situ_linear_beta",
        "situ_linear_beta",
        "model_max_length",
    }
)
KIMI_IGNORED: dict[str, str] = {
    "num_key_value_heads": "MLA caches one latent shared by all heads",
    "mla_use_nope": "MLA without RoPE on the nope part: changes values, not bytes",
    "topk_group": "group-limited routing (config_from_hf requires one group)",
    "use_grouped_topk": "as topk_group",
    "head_dim": "the MLA head widths are qk_nope/qk_rope/v_head_dim, the KDA head linear_attn_config.head_dim",
}
KIMI_LINEAR_ATTN_READ = frozenset(
    {"full_attn_layers", "kda_layers", "num_heads", "head_dim", "short_conv_kernel_size", "gate_lower_bound", "use_full_rank_gate"}
)
K3_TOP_LEVEL_IGNORED: dict[str, str] = {
    "vision_config": "the vision tower is not modelled",
    "media_placeholder_token_id": "tokenizer id",
    "ignore_index": "training only",
}


def check_keys(raw: dict[str, Any], family: str, read: frozenset[str], ignored: dict[str, str], where: str = "config.json") -> tuple[str, ...]:
    """The keys of `raw` the planner ignores on purpose; raises naming every key it does not understand."""
    known_ignored = COMMON_IGNORED | ignored
    unknown = sorted(k for k in raw if k not in read and k not in known_ignored)
    if unknown:
        raise ValueError(
            f"{where}: {', '.join(repr(k) for k in unknown)} not understood by the planner for {family} configs "
            f"(it reads {len(read)} keys and ignores {len(known_ignored)} listed in openk3/planner/hf_keys.py); "
            "remove the key or extend the planner"
        )
    return tuple(sorted(k for k in raw if k in known_ignored and k not in read))
