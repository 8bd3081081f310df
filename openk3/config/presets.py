"""The model presets: K3 and Kimi-Linear 48B as released, and the small tiny (demo) and debug (tests) models."""

from __future__ import annotations

from openk3.config.model import Activation, KDAConfig, KDAGate, MLAConfig, ModelConfig, MoEConfig


def k3_schedule(num_layers: int) -> tuple[int, ...]:
    """MLA iff (i + 1) % 4 == 0 or i is the last layer (K3 ends on an MLA layer)."""
    return tuple(i for i in range(num_layers) if (i + 1) % 4 == 0 or i == num_layers - 1)


def k3() -> ModelConfig:
    """The released Kimi K3 text backbone (shared/spec/model.md section 1)."""
    return ModelConfig(
        name="k3",
        vocab_size=163840,
        hidden_size=7168,
        num_hidden_layers=93,
        mla_layers=k3_schedule(93),
        kda=KDAConfig(num_heads=96, head_dim=128, conv_kernel=4, gate=KDAGate.LOWER_BOUND, gate_lower_bound=-5.0, full_rank_output_gate=True),
        mla=MLAConfig(num_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, output_gate=True),
        moe=MoEConfig(
            num_experts=896,
            num_experts_per_token=16,
            moe_intermediate_size=3072,
            num_shared_experts=2,
            latent_size=3584,
            latent_norm=True,
            routed_scaling_factor=1.0,
        ),
        intermediate_size=33792,
        first_k_dense_replace=1,
        hidden_act=Activation.SITU,
        attn_res_block_size=12,
        expert_quantization="mxfp4",
        bos_token_id=163584,
        eos_token_id=163586,
        pad_token_id=163839,
    )


def kimi_linear_48b() -> ModelConfig:
    """Kimi-Linear-48B-A3B, K3's open predecessor: softplus gate, plain residuals, full-width experts, SiLU."""
    return ModelConfig(
        name="kimi_linear_48b",
        vocab_size=163840,
        hidden_size=2304,
        num_hidden_layers=27,
        mla_layers=(3, 7, 11, 15, 19, 23, 26),
        kda=KDAConfig(num_heads=32, head_dim=128, conv_kernel=4),
        mla=MLAConfig(num_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        moe=MoEConfig(num_experts=256, num_experts_per_token=8, moe_intermediate_size=1024, num_shared_experts=1, routed_scaling_factor=2.446),
        intermediate_size=9216,
        bos_token_id=163584,
        eos_token_id=163586,
        pad_token_id=163839,
    )


def tiny(vocab_size: int = 4096) -> ModelConfig:
    """The embedded demo model (~12M parameters) with every K3 feature on."""
    return ModelConfig(
        name="tiny",
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=8,
        mla_layers=k3_schedule(8),
        kda=KDAConfig(num_heads=4, head_dim=64, conv_kernel=4, gate=KDAGate.LOWER_BOUND, gate_lower_bound=-5.0, full_rank_output_gate=True),
        mla=MLAConfig(num_heads=4, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64, output_gate=True),
        moe=MoEConfig(
            num_experts=16,
            num_experts_per_token=4,
            moe_intermediate_size=128,
            num_shared_experts=2,
            latent_size=128,
            latent_norm=True,
        ),
        intermediate_size=768,
        hidden_act=Activation.SITU,
        attn_res_block_size=4,
        expert_quantization="mxfp4",
        max_position_embeddings=8192,
    )


def debug() -> ModelConfig:
    """A few small layers with every K3 feature on, for unit tests (runs in milliseconds)."""
    return ModelConfig(
        name="debug",
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=5,
        mla_layers=k3_schedule(5),
        kda=KDAConfig(num_heads=2, head_dim=16, conv_kernel=4, gate=KDAGate.LOWER_BOUND, gate_lower_bound=-5.0, full_rank_output_gate=True),
        mla=MLAConfig(num_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, output_gate=True),
        moe=MoEConfig(num_experts=8, num_experts_per_token=2, moe_intermediate_size=32, num_shared_experts=1, latent_size=32, latent_norm=True),
        intermediate_size=128,
        hidden_act=Activation.SITU,
        attn_res_block_size=2,
        max_position_embeddings=4096,
    )


PRESETS = {"debug": debug, "tiny": tiny, "kimi_linear_48b": kimi_linear_48b, "k3": k3}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None
