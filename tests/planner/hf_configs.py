"""config.json files for the planner's model families, written here (not copied) with the published shapes.

Shapes used (public HF config.json files and model cards):
- DeepSeek-V3/R1, deepseek-ai/DeepSeek-V3: 61 layers (3 dense), hidden 7168, MLA 128 heads, q_lora 1536, kv_lora 512,
  qk 128 + 64 rope, v 128, 256 routed experts top-8 of width 2048 + 1 shared, dense 18432, vocab 129280, 8 expert
  groups (top-4), 1 MTP layer, block-FP8 weights (128 x 128). Published: 671B total (main model), 37B active.
- Kimi K2, moonshotai/Kimi-K2-Instruct: as DeepSeek-V3 but 64 heads, 384 experts, 1 dense layer, vocab 163840, one
  expert group, no MTP layer. Published: 1.04T total (tech report; model card "1T"), 32B active.
- Qwen3-235B-A22B, Qwen/Qwen3-235B-A22B: 94 layers, hidden 4096, GQA 64 query / 4 KV heads of 128, 128 experts top-8
  of width 1536, no shared expert, vocab 151936, untied head, bf16. Published: 235B total, 22B active.
Each builder takes overrides so tests can also write small configs of the same families.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def deepseek_v3(**over: Any) -> dict[str, Any]:
    c: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "ep_size": 1,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "topk_method": "noaux_tc",
        "n_group": 8,
        "topk_group": 4,
        "num_experts_per_tok": 8,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096},
        "attention_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]},
    }
    return c | over


def kimi_k2(**over: Any) -> dict[str, Any]:
    c = deepseek_v3(
        model_type="kimi_k2",
        vocab_size=163840,
        num_attention_heads=64,
        num_key_value_heads=64,
        n_routed_experts=384,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        num_nextn_predict_layers=0,
        routed_scaling_factor=2.827,
        max_position_embeddings=131072,
        rope_theta=50000.0,
        rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 1.0},
        bos_token_id=163584,
        eos_token_id=163585,
    )
    return c | over


def qwen3_moe(**over: Any) -> dict[str, Any]:
    c: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 94,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
    }
    return c | over


def write(tmp: Path, config: dict[str, Any], name: str = "config.json") -> Path:
    path = tmp / name
    path.write_text(json.dumps(config))
    return path
