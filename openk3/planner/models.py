"""Model configs the planner knows by name: openk3's presets plus the published MoE models its anchors use.

Kimi K2 and DeepSeek-V3 are all-MLA models; `ModelConfig` still carries a KDA sub-config, unused when every layer is
MLA. `k3_all_mla` is K3 with every layer MLA: the counterfactual that shows what KDA saves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from openk3.config import PRESETS, MLAConfig, ModelConfig, MoEConfig, k3
from openk3.planner.hf_load import HFModel, gqa_moe, load_hf_model


def kimi_k2() -> ModelConfig:
    """Kimi K2 (HF moonshotai/Kimi-K2-Instruct config.json): 61 layers, MLA 64 heads, 384 experts top-8, ~1.03T / 32B."""
    return ModelConfig(
        name="kimi_k2",
        vocab_size=163840,
        hidden_size=7168,
        num_hidden_layers=61,
        mla_layers=tuple(range(61)),
        kda=k3().kda,
        mla=MLAConfig(num_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        moe=MoEConfig(num_experts=384, num_experts_per_token=8, moe_intermediate_size=2048, num_shared_experts=1, routed_scaling_factor=2.827),
        intermediate_size=18432,
        first_k_dense_replace=1,
    )


def deepseek_v3() -> ModelConfig:
    """DeepSeek-V3/R1 (HF deepseek-ai/DeepSeek-V3 config.json): 61 layers, 3 dense, MLA 128 heads, 256 experts top-8, 671B / 37B."""
    return ModelConfig(
        name="deepseek_v3",
        vocab_size=129280,
        hidden_size=7168,
        num_hidden_layers=61,
        mla_layers=tuple(range(61)),
        kda=k3().kda,
        mla=MLAConfig(num_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        moe=MoEConfig(num_experts=256, num_experts_per_token=8, moe_intermediate_size=2048, num_shared_experts=1, routed_scaling_factor=2.5),
        intermediate_size=18432,
        first_k_dense_replace=3,
    )


def qwen3_235b() -> ModelConfig:
    """Qwen3-235B-A22B (HF Qwen/Qwen3-235B-A22B config.json): 94 layers, GQA 64 heads / 4 KV heads of 128, 128 experts
    top-8 of width 1536, no shared expert, ~235B / 22B."""
    return gqa_moe(
        {
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
            "hidden_act": "silu",
            "attention_bias": False,
            "use_sliding_window": False,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": False,
            "_name_or_path": "qwen3_235b",
        }
    )


def qwen3_30b_a3b() -> ModelConfig:
    """Qwen3-30B-A3B (HF Qwen/Qwen3-30B-A3B config.json): 48 layers, GQA 32 heads / 4 KV heads of 128, 128 experts
    top-8 of width 768, no shared expert, ~30.5B / 3.3B."""
    return gqa_moe(
        {
            "model_type": "qwen3_moe",
            "vocab_size": 151936,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "hidden_act": "silu",
            "attention_bias": False,
            "use_sliding_window": False,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": False,
            "_name_or_path": "qwen3_30b_a3b",
        }
    )


def k3_all_mla() -> ModelConfig:
    """K3 with every layer gated MLA (same widths): the baseline for 'what does KDA save'."""
    base = k3()
    return base.replace(name="k3_all_mla", mla_layers=tuple(range(base.num_hidden_layers)))


MODELS: dict[str, Callable[[], ModelConfig]] = {
    **PRESETS,
    "kimi_k2": kimi_k2,
    "deepseek_v3": deepseek_v3,
    "k3_all_mla": k3_all_mla,
    "qwen3_235b": qwen3_235b,
    "qwen3_30b_a3b": qwen3_30b_a3b,
}


def model_by_name(name: str) -> ModelConfig:
    try:
        return MODELS[name]()
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}") from None


@dataclass(frozen=True)
class ModelSource:
    config: ModelConfig
    default_quant: str  # the Quantisation preset used when --quant is not given
    hf: HFModel | None  # what was read, when the model came from a config.json


def resolve_model(spec: str) -> ModelSource:
    """A preset name (default formats: K3's release, MXFP4 experts + bf16) or a path to an HF config.json / its folder
    (default formats: the checkpoint's own quantization_config)."""
    if spec in MODELS:
        return ModelSource(MODELS[spec](), "mxfp4", None)
    if spec.endswith(".json") or Path(spec).exists():
        hf = load_hf_model(spec)
        return ModelSource(hf.config, hf.checkpoint_quant, hf)
    raise ValueError(f"unknown model {spec!r}: not a preset ({', '.join(sorted(MODELS))}) and no such config.json or folder")
