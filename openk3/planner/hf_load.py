"""`--model path/to/config.json` (or a folder holding one): an HF config read into the planner's ModelConfig.

Families, by `model_type`:
- `kimi_k3`, `kimi_linear`: K3 and Kimi-Linear, read by openk3's own `config_from_hf` (the engine reads the same);
- `deepseek_v3`, `kimi_k2`: DeepSeek-V3/R1 and Kimi K2, MLA + MoE with no KDA layer (every layer is MLA);
- `qwen3_moe`: GQA attention + MoE without shared experts (Qwen3-30B-A3B, Qwen3-235B-A22B), as a `GQAModelConfig`.
Every key is either read or on a documented ignore list (hf_keys.py); anything else is an error naming it. The
checkpoint's `quantization_config` gives the default formats (fp8 block-quantised, MXFP4 experts, or none: bf16).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openk3.config import MLAConfig, ModelConfig, MoEConfig, config_from_hf, k3
from openk3.planner.attention import GQAConfig, GQAModelConfig
from openk3.planner.hf_keys import (
    COMMON_IGNORED,
    GQA_MOE_IGNORED,
    GQA_MOE_READ,
    K3_TOP_LEVEL_IGNORED,
    KIMI_IGNORED,
    KIMI_LINEAR_ATTN_READ,
    KIMI_READ,
    MLA_MOE_IGNORED,
    MLA_MOE_READ,
    check_keys,
)

FAMILIES = ("kimi_k3", "kimi_linear", "deepseek_v3", "kimi_k2", "qwen3_moe")


@dataclass(frozen=True)
class HFModel:
    config: ModelConfig
    family: str
    checkpoint_quant: str  # a Quantisation preset name: "fp8", "mxfp4" or "bf16"
    mtp_layers: int
    ignored_keys: tuple[str, ...]  # keys present and deliberately not used (tokenizer ids, RoPE scaling, ...)


def _get(d: dict[str, Any], key: str, default: Any = None, required: bool = True) -> Any:
    if key in d and d[key] is not None:
        return d[key]
    if required and default is None:
        raise ValueError(f"config.json is missing the field {key!r}")
    return default


def _expect(d: dict[str, Any], key: str, allowed: Any, default: Any) -> None:
    value = d.get(key, default)
    if value != allowed:
        raise ValueError(f"config.json {key}={value!r} is not supported by the planner: expected {allowed!r}")


def checkpoint_quant(qc: dict[str, Any] | None) -> str:
    """The Quantisation preset a checkpoint's quantization_config describes."""
    if not qc:
        return "bf16"
    text = json.dumps(qc).lower()
    method = str(qc.get("quant_method", "")).lower()
    if "mxfp4" in text:
        return "mxfp4"
    if method == "fp8":
        return "fp8"
    raise ValueError(
        f"config.json quantization_config.quant_method={qc.get('quant_method')!r} is not understood by the planner "
        "(it reads fp8 and MXFP4 checkpoints); pass --quant or --expert-dtype/--trunk-dtype for your formats"
    )


def _mla_moe(tc: dict[str, Any]) -> ModelConfig:
    _expect(tc, "moe_layer_freq", 1, 1)
    _expect(tc, "hidden_act", "silu", "silu")
    _expect(tc, "attention_bias", False, False)
    n = int(_get(tc, "num_hidden_layers"))
    return ModelConfig(
        name=str(tc.get("_name_or_path") or tc["model_type"]),
        vocab_size=int(_get(tc, "vocab_size")),
        hidden_size=int(_get(tc, "hidden_size")),
        num_hidden_layers=n,
        mla_layers=tuple(range(n)),
        kda=k3().kda,  # unread: no layer is KDA
        mla=MLAConfig(
            num_heads=int(_get(tc, "num_attention_heads")),
            q_lora_rank=tc.get("q_lora_rank"),
            kv_lora_rank=int(_get(tc, "kv_lora_rank")),
            qk_nope_head_dim=int(_get(tc, "qk_nope_head_dim")),
            qk_rope_head_dim=int(_get(tc, "qk_rope_head_dim")),
            v_head_dim=int(_get(tc, "v_head_dim")),
        ),
        moe=MoEConfig(
            num_experts=int(_get(tc, "n_routed_experts")),
            num_experts_per_token=int(_get(tc, "num_experts_per_tok")),
            moe_intermediate_size=int(_get(tc, "moe_intermediate_size")),
            num_shared_experts=int(tc.get("n_shared_experts") or 0),
        ),
        intermediate_size=int(_get(tc, "intermediate_size")),
        first_k_dense_replace=int(_get(tc, "first_k_dense_replace", default=0)),
        max_position_embeddings=int(_get(tc, "max_position_embeddings", default=1 << 20)),
        tie_word_embeddings=bool(tc.get("tie_word_embeddings", False)),
    )


def _dense_prefix(tc: dict[str, Any], n: int) -> int:
    """Qwen's dense layers (`mlp_only_layers`, `decoder_sparse_step`) as ModelConfig's first-k dense layers."""
    step = int(tc.get("decoder_sparse_step") or 1)
    dense = sorted(int(i) for i in tc.get("mlp_only_layers") or [])
    if step != 1:
        raise ValueError(f"config.json decoder_sparse_step={step} is not supported by the planner: expected 1 (MoE in every layer)")
    if dense != list(range(len(dense))) or len(dense) > n:
        raise ValueError(f"config.json mlp_only_layers={dense} is not supported by the planner: expected the first k layers")
    return len(dense)


def gqa_moe(tc: dict[str, Any]) -> ModelConfig:
    _expect(tc, "hidden_act", "silu", "silu")
    _expect(tc, "attention_bias", False, False)
    _expect(tc, "use_sliding_window", False, False)
    n = int(_get(tc, "num_hidden_layers"))
    hidden, heads = int(_get(tc, "hidden_size")), int(_get(tc, "num_attention_heads"))
    gqa = GQAConfig(
        num_heads=heads,
        num_kv_heads=int(_get(tc, "num_key_value_heads", default=heads)),
        head_dim=int(_get(tc, "head_dim", default=hidden // heads)),
        qk_norm=True,
    )
    if gqa.head_dim < 2:
        raise ValueError(f"config.json head_dim={gqa.head_dim} is invalid: expected >= 2")
    first_dense = _dense_prefix(tc, n)
    moe_inter = int(_get(tc, "moe_intermediate_size"))
    return GQAModelConfig(
        name=str(tc.get("_name_or_path") or tc["model_type"]),
        vocab_size=int(_get(tc, "vocab_size")),
        hidden_size=hidden,
        num_hidden_layers=n,
        mla_layers=tuple(range(n)),  # every layer is full attention, described by `gqa`
        kda=k3().kda,  # unread: no layer is KDA
        # unread placeholder whose widths match the GQA cache (latent_dim = 2 x kv_heads x head_dim) and heads
        mla=MLAConfig(
            num_heads=heads,
            q_lora_rank=None,
            kv_lora_rank=2 * gqa.num_kv_heads * gqa.head_dim - 1,
            qk_nope_head_dim=gqa.head_dim - 1,
            qk_rope_head_dim=1,
            v_head_dim=gqa.head_dim,
        ),
        moe=MoEConfig(
            num_experts=int(_get(tc, "num_experts")),
            num_experts_per_token=int(_get(tc, "num_experts_per_tok")),
            moe_intermediate_size=moe_inter,
            num_shared_experts=0,
        ),
        # the dense MLP width matters only for mlp_only_layers; without them it would only inflate the workspace estimate
        intermediate_size=int(_get(tc, "intermediate_size")) if first_dense else moe_inter,
        first_k_dense_replace=first_dense,
        max_position_embeddings=int(_get(tc, "max_position_embeddings", default=1 << 20)),
        tie_word_embeddings=bool(tc.get("tie_word_embeddings", False)),
        gqa=gqa,
        router_bias=False,
    )


def _kimi(raw: dict[str, Any]) -> tuple[ModelConfig, tuple[str, ...]]:
    ignored: tuple[str, ...] = ()
    tc = raw
    if "text_config" in raw:
        top_read = frozenset({"model_type", "text_config"})
        ignored = check_keys(raw, "kimi_k3 (top level)", top_read, K3_TOP_LEVEL_IGNORED)
        tc = raw["text_config"]
    ignored += check_keys(tc, "kimi_linear/kimi_k3", KIMI_READ, KIMI_IGNORED, where="config.json text backbone")
    lac = tc.get("linear_attn_config") or {}
    check_keys(lac, "kimi_linear", KIMI_LINEAR_ATTN_READ, {}, where="config.json linear_attn_config")
    return config_from_hf(raw), ignored


def read_config(source: str | Path) -> dict[str, Any]:
    path = Path(source)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"--model {source!s}: no config.json there (expected a preset name, a config.json or a folder holding one)")
    try:
        return dict(json.loads(file.read_text()))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--model {file}: not valid JSON ({exc})") from None


def load_hf_model(source: str | Path) -> HFModel:
    raw = read_config(source)
    family = str(raw.get("model_type", ""))
    if family not in FAMILIES:
        raise ValueError(f"config.json model_type={family!r} is not supported by the planner: expected one of {list(FAMILIES)}")
    tc = raw.get("text_config") if family == "kimi_k3" else raw
    if not isinstance(tc, dict):
        raise ValueError("a kimi_k3 config.json must hold the text backbone in 'text_config'")
    if family in ("kimi_k3", "kimi_linear"):
        config, ignored = _kimi(raw)
    elif family in ("deepseek_v3", "kimi_k2"):
        ignored = check_keys(raw, family, MLA_MOE_READ, MLA_MOE_IGNORED)
        config = _mla_moe(raw)
    else:
        ignored = check_keys(raw, family, GQA_MOE_READ, GQA_MOE_IGNORED)
        config = gqa_moe(raw)
    qc = tc.get("quantization_config") or raw.get("quantization_config")
    not_read = tuple(k for k in ignored if not COMMON_IGNORED.get(k, "").startswith("read:"))
    return HFModel(config, family, checkpoint_quant(qc), int(tc.get("num_nextn_predict_layers") or 0), not_read)
