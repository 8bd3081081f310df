"""A small K3 EAGLE-3 MLA head folder as TorchSpec's Kimi-K3 draft config lays it out (config.json with
Eagle3DeepseekV2ForCausalLM, `mla_use_nope: true`, DeepSeek MLA fields, NeMo's `mla_use_output_gate` and SiTU `hidden_act`;
model.safetensors with `fc`, `layers.0.*`, `norm`, `lm_head`, `d2t`, `t2d`), random weights, for a given target."""

from __future__ import annotations

from typing import Any

import torch

from openk3.config import ModelConfig


def mla_head_config(target: ModelConfig, draft_vocab: int, aux: list[int], **extra: Any) -> dict[str, Any]:
    """Dimensions unlike the target's MLA layers (3 heads, ranks 24 / 20, head dims 12 / 6 / 10): the head's own."""
    cfg: dict[str, Any] = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "kimi_k2",
        "torch_dtype": "float32",
        "hidden_size": target.hidden_size,
        "intermediate_size": 80,
        "num_hidden_layers": 1,
        "num_attention_heads": 3,
        "num_key_value_heads": 3,
        "q_lora_rank": 24,
        "kv_lora_rank": 20,
        "qk_nope_head_dim": 12,
        "qk_rope_head_dim": 6,
        "v_head_dim": 10,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "hidden_act": "situ",
        "rms_norm_eps": 1e-5,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab,
        "rope_theta": 50000.0,
        "max_position_embeddings": 4096,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True, "use_mtp_layernorm": False},
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    return cfg | extra


def mla_head_tensors(target: ModelConfig, cfg: dict[str, Any], seed: int = 11) -> dict[str, torch.Tensor]:
    """Random weights under the published names (`layers.0.*`, as TorchSpec and NeMo write the layer); norms away from 1;
    a d2t mapping the draft ids to a scattered subset of the target's ids and the t2d marking them."""
    g = torch.Generator().manual_seed(seed)
    h, ffn, vd, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["draft_vocab_size"], cfg["vocab_size"]
    n, qr, kr = cfg["num_attention_heads"], cfg["q_lora_rank"], cfg["kv_lora_rank"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]

    def mat(rows: int, cols: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * scale

    def norm(dim: int) -> torch.Tensor:
        return 1.0 + 0.3 * torch.randn(dim, generator=g)

    a = "layers.0.self_attn."
    t = {
        "fc.weight": mat(h, 3 * target.hidden_size, 0.1),
        "layers.0.input_layernorm.weight": norm(h),
        "layers.0.hidden_norm.weight": norm(h),
        a + "q_a_proj.weight": mat(qr, 2 * h),
        a + "q_a_layernorm.weight": norm(qr),
        a + "q_b_proj.weight": mat(n * (dn + dr), qr, 0.4),
        a + "kv_a_proj_with_mqa.weight": mat(kr + dr, 2 * h),
        a + "kv_a_layernorm.weight": norm(kr),
        a + "kv_b_proj.weight": mat(n * (dn + dv), kr, 0.4),
        a + "o_proj.weight": mat(h, n * dv, 0.3),
        "layers.0.post_attention_layernorm.weight": norm(h),
        "layers.0.mlp.gate_proj.weight": mat(ffn, h),
        "layers.0.mlp.up_proj.weight": mat(ffn, h),
        "layers.0.mlp.down_proj.weight": mat(h, ffn),
        "norm.weight": norm(h),
        "lm_head.weight": mat(vd, h, 0.5),
    }
    if cfg.get("mla_use_output_gate"):
        t[a + "g_proj.weight"] = mat(n * dv, 2 * h)
    if cfg.get("fc_norm"):
        t |= {f"fc_norm.{i}.weight": norm(target.hidden_size) for i in range(3)}
    chosen = torch.randperm(v, generator=g)[:vd].sort().values
    t["d2t"] = chosen - torch.arange(vd)
    t["t2d"] = torch.zeros(v, dtype=torch.bool).index_fill_(0, chosen, True)
    return t
