"""A small EAGLE-3 head folder as published heads lay it out (config.json with LlamaForCausalLMEagle3 and its fields,
model.safetensors with `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`), random weights, for a given target."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from openk3.config import ModelConfig


def head_config(target: ModelConfig, draft_vocab: int, aux: list[int] | None = None, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "torch_dtype": "float32",
        "transformers_version": "4.51.0",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "initializer_range": 0.02,
        "use_cache": True,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
        "hidden_size": target.hidden_size,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab,
    }
    if aux is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True}
    return cfg | extra


def head_tensors(target: ModelConfig, cfg: dict[str, Any], seed: int = 5, own_embedding: bool = False) -> dict[str, torch.Tensor]:
    """Random weights under the published names; norms away from 1 so each one matters; a d2t that maps the draft ids to
    a scattered subset of the target's ids (and the t2d that marks them)."""
    g = torch.Generator().manual_seed(seed)
    h, ffn, vd, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["draft_vocab_size"], cfg["vocab_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // heads

    def mat(rows: int, cols: int, scale: float = 0.15) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) * scale

    def norm() -> torch.Tensor:
        return 1.0 + 0.3 * torch.randn(h, generator=g)

    t = {
        "fc.weight": mat(h, 3 * target.hidden_size, 0.1),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.self_attn.q_proj.weight": mat(heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": mat(kv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": mat(kv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": mat(h, heads * d),
        "midlayer.post_attention_layernorm.weight": norm(),
        "midlayer.mlp.gate_proj.weight": mat(ffn, h),
        "midlayer.mlp.up_proj.weight": mat(ffn, h),
        "midlayer.mlp.down_proj.weight": mat(h, ffn),
        "norm.weight": norm(),
        "lm_head.weight": mat(vd, h, 0.5),
    }
    chosen = torch.randperm(v, generator=g)[:vd].sort().values
    t["d2t"] = chosen - torch.arange(vd)
    t["t2d"] = torch.zeros(v, dtype=torch.bool).index_fill_(0, chosen, True)
    if own_embedding:
        t["embed_tokens.weight"] = mat(v, h, 1.0)
    return t


def write_head(path: Path, cfg: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({n: x.contiguous() for n, x in tensors.items()}, str(path / "model.safetensors"))
    return path
