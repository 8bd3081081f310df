"""Reading and writing HF `config.json` for ModelConfig.

Accepted inputs: the K3 multimodal config (top-level `model_type: kimi_k3`, text backbone in `text_config`), Moonshot's
Kimi-Linear config (`linear_attn_config` with 1-based `full_attn_layers`), and the config written by transformers'
`KimiLinearConfig` (explicit `layer_types`, attribute-mapped names such as `num_experts_per_token`, `model_max_length`).
When a config names no layer schedule at all we use K3's rule ((i+1) % 4 == 0 or the last layer), not transformers'
default (`i % 4 == 0 and i > 0`), because the released checkpoints follow the former; docs/model.md records the difference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from openk3.config.model import Activation, KDAConfig, KDAGate, MLAConfig, ModelConfig, MoEConfig
from openk3.config.presets import k3_schedule
from openk3.config.vision import VisionConfig, vision_from_hf, vision_to_hf


def _first(d: dict[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        if n in d and d[n] is not None:
            return d[n]
    return default


def _require(d: dict[str, Any], *names: str) -> Any:
    value = _first(d, *names)
    if value is None:
        raise ValueError(f"config.json is missing the field {names[0]!r}" + (f" (or {', '.join(names[1:])})" if len(names) > 1 else ""))
    return value


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("model_type") == "kimi_k3" or ("text_config" in raw and "hidden_size" not in raw):
        if "text_config" not in raw:
            raise ValueError("a kimi_k3 config.json must hold the text backbone in 'text_config'")
        return raw["text_config"]
    return raw


def _mla_layers(tc: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    lac = tc.get("linear_attn_config") or {}
    if "full_attn_layers" in lac:
        return tuple(sorted(i - 1 for i in lac["full_attn_layers"]))  # 1-based in the checkpoint
    if tc.get("layer_types"):
        types = tc["layer_types"]
        if len(types) != num_layers:
            raise ValueError(f"config.json layer_types has {len(types)} entries, expected num_hidden_layers={num_layers}")
        unknown = set(types) - {"full_attention", "linear_attention"}
        if unknown:
            raise ValueError(f"config.json layer_types holds unknown kinds {sorted(unknown)}; expected full_attention / linear_attention")
        return tuple(i for i, t in enumerate(types) if t == "full_attention")
    return k3_schedule(num_layers)


def _first_dense(tc: dict[str, Any]) -> int:
    if tc.get("mlp_layer_types"):
        types = tc["mlp_layer_types"]
        n_dense = next((i for i, t in enumerate(types) if t != "dense"), len(types))
        if any(t == "dense" for t in types[n_dense:]):
            raise ValueError("config.json mlp_layer_types: dense layers after the first MoE layer are not supported")
        return n_dense
    return int(_first(tc, "first_k_dense_replace", default=1))


def _read(source: str | Path | dict[str, Any]) -> dict[str, Any]:
    if isinstance(source, dict):
        return source
    path = Path(source)
    return dict(json.loads((path / "config.json" if path.is_dir() else path).read_text()))


def mtp_layer_count(source: str | Path | dict[str, Any]) -> int:
    """How many multi-token-prediction layers the checkpoint declares (`num_nextn_predict_layers`, DeepSeek-V3's name, which
    Kimi's configs use): they are stored as decoder layers num_hidden_layers.. and are not part of this model (yet)."""
    raw = _read(source)
    return int(_first(_text_config(raw), "num_nextn_predict_layers", default=raw.get("num_nextn_predict_layers") or 0))


def vision_config_from_hf(source: str | Path | dict[str, Any]) -> VisionConfig | None:
    """The vision tower a multimodal config.json declares (`vision_config`, config/vision.py), or None. Kept apart from
    ModelConfig, which describes the text model alone (the planner and the engine read that)."""
    raw = _read(source)
    if raw.get("vision_config") is None:
        return None
    return vision_from_hf(raw["vision_config"], int(_require(_text_config(raw), "hidden_size")))


TOPK_METHODS = ("noaux_tc",)  # sigmoid scores, the selection-only correction bias, plain top-k: what model/moe.py computes


def _refuse_unsupported(tc: dict[str, Any]) -> None:
    """config.json keys that would change the model's math, read by name: a value openk3 does not compute is refused
    (never loaded as if it said the release's value)."""
    groups = int(_first(tc, "num_expert_group", "n_group", default=1))
    if groups != 1:
        raise ValueError(f"config.json num_expert_group={groups} (group-limited routing) is not supported: K3 and Kimi Linear use 1")
    if bool(tc.get("use_grouped_topk", False)) and int(_first(tc, "topk_group", default=1)) != 1:
        raise ValueError(f"config.json use_grouped_topk with topk_group={tc['topk_group']!r} is not supported: with one group it must be 1")
    if tc.get("mla_use_nope", True) is not True:
        raise ValueError(f"config.json mla_use_nope={tc['mla_use_nope']!r} is not supported: openk3's MLA layers use no positional encoding (true)")
    method = tc.get("topk_method")
    if method is not None and method not in TOPK_METHODS:
        raise ValueError(f"config.json topk_method={method!r} is not supported: openk3 routes as {', '.join(TOPK_METHODS)}")
    heads, kv_heads = tc.get("num_attention_heads"), tc.get("num_key_value_heads")
    if kv_heads is not None and heads is not None and int(kv_heads) != int(heads):
        raise ValueError(f"config.json num_key_value_heads={kv_heads} differs from num_attention_heads={heads}: MLA has no grouped KV heads")


def config_from_hf(source: str | Path | dict[str, Any]) -> ModelConfig:
    raw = _read(source)
    tc = _text_config(raw)
    lac = tc.get("linear_attn_config") or {}
    num_layers = int(_require(tc, "num_hidden_layers"))
    _refuse_unsupported(tc)
    if str(_first(tc, "moe_router_activation_func", default="sigmoid")) != "sigmoid":
        raise ValueError(f"config.json moe_router_activation_func={tc['moe_router_activation_func']!r} is not supported: expected 'sigmoid'")
    if int(_first(tc, "moe_layer_freq", default=1)) != 1:
        raise ValueError(f"config.json moe_layer_freq={tc['moe_layer_freq']!r} is not supported: expected 1 (every layer after the dense ones is MoE)")
    lower_bound = lac.get("gate_lower_bound")
    hidden_act = Activation(_first(tc, "hidden_act", default="silu"))
    latent = tc.get("routed_expert_hidden_size")
    qc = tc.get("quantization_config") or raw.get("quantization_config") or {}
    quant = "mxfp4" if "mxfp4" in json.dumps(qc).lower() else None
    head_dim = int(_first(lac, "head_dim", default=_first(tc, "linear_head_dim", default=128)))
    return ModelConfig(
        name=str(_first(tc, "_name_or_path", default="hf")),
        vocab_size=int(_require(tc, "vocab_size")),
        hidden_size=int(_require(tc, "hidden_size")),
        num_hidden_layers=num_layers,
        mla_layers=_mla_layers(tc, num_layers),
        kda=KDAConfig(
            num_heads=int(_first(lac, "num_heads", default=_first(tc, "linear_num_heads", default=32))),
            head_dim=head_dim,
            conv_kernel=int(_first(lac, "short_conv_kernel_size", default=_first(tc, "linear_conv_kernel_dim", default=4))),
            gate=KDAGate.LOWER_BOUND if lower_bound is not None else KDAGate.SOFTPLUS,
            gate_lower_bound=float(lower_bound) if lower_bound is not None else None,
            full_rank_output_gate=bool(lac.get("use_full_rank_gate", False)),
        ),
        mla=MLAConfig(
            num_heads=int(_require(tc, "num_attention_heads")),
            q_lora_rank=tc.get("q_lora_rank"),
            kv_lora_rank=int(_require(tc, "kv_lora_rank")),
            qk_nope_head_dim=int(_require(tc, "qk_nope_head_dim")),
            qk_rope_head_dim=int(_require(tc, "qk_rope_head_dim")),
            v_head_dim=int(_require(tc, "v_head_dim")),
            output_gate=bool(tc.get("mla_use_output_gate", False)),
        ),
        moe=MoEConfig(
            num_experts=int(_require(tc, "num_experts", "num_local_experts", "n_routed_experts")),
            num_experts_per_token=int(_require(tc, "num_experts_per_token", "num_experts_per_tok")),
            moe_intermediate_size=int(_require(tc, "moe_intermediate_size")),
            num_shared_experts=_shared_experts(tc),
            latent_size=int(latent) if latent else None,
            latent_norm=bool(latent) and bool(tc.get("latent_moe_use_norm", False)),
            routed_scaling_factor=float(_first(tc, "routed_scaling_factor", default=1.0)),
            renormalize=bool(_first(tc, "moe_renormalize", "norm_topk_prob", default=True)),
        ),
        intermediate_size=int(_require(tc, "intermediate_size")),
        first_k_dense_replace=_first_dense(tc),
        hidden_act=hidden_act,
        situ_beta=float(_first(tc, "activation_situ_beta", "situ_beta", default=4.0)),
        situ_linear_beta=float(_first(tc, "activation_situ_linear_beta", "situ_linear_beta", default=25.0)),
        attn_res_block_size=tc.get("attn_res_block_size"),
        rms_norm_eps=float(_first(tc, "rms_norm_eps", default=1e-5)),
        max_position_embeddings=int(_first(tc, "max_position_embeddings", "model_max_length", default=1048576)),
        tie_word_embeddings=bool(_first(tc, "tie_word_embeddings", default=raw.get("tie_word_embeddings", False))),
        expert_quantization=quant,
        bos_token_id=_first(tc, "bos_token_id", default=raw.get("bos_token_id")),
        eos_token_id=_eos(_first(tc, "eos_token_id", default=raw.get("eos_token_id"))),
        pad_token_id=_first(tc, "pad_token_id", default=raw.get("pad_token_id")),
    )


def _shared_experts(tc: dict[str, Any]) -> int:
    """An explicit null means no shared experts (as the reference code reads it); an absent field means one."""
    for name in ("num_shared_experts", "n_shared_experts"):
        if name in tc:
            return 0 if tc[name] is None else int(tc[name])
    return 1


def _eos(value: Any) -> int | None:
    return value[0] if isinstance(value, list) and value else value


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    """A `kimi_linear` config.json that transformers' KimiLinearConfig reads, plus K3's fields when K3 features are on."""
    out: dict[str, Any] = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "intermediate_size": c.intermediate_size,
        "moe_intermediate_size": c.moe.moe_intermediate_size,
        "num_attention_heads": c.mla.num_heads,
        "num_key_value_heads": c.mla.num_heads,
        "q_lora_rank": c.mla.q_lora_rank,
        "kv_lora_rank": c.mla.kv_lora_rank,
        "qk_nope_head_dim": c.mla.qk_nope_head_dim,
        "qk_rope_head_dim": c.mla.qk_rope_head_dim,
        "v_head_dim": c.mla.v_head_dim,
        "mla_use_nope": True,
        "num_experts": c.moe.num_experts,
        "num_experts_per_token": c.moe.num_experts_per_token,
        "num_shared_experts": c.moe.num_shared_experts,
        "first_k_dense_replace": c.first_k_dense_replace,
        "routed_scaling_factor": c.moe.routed_scaling_factor,
        "moe_renormalize": c.moe.renormalize,
        "num_expert_group": 1,
        "topk_group": 1,
        "hidden_act": c.hidden_act.value,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "layer_types": ["full_attention" if k.value == "mla" else "linear_attention" for k in c.layer_kinds],
        "mlp_layer_types": ["sparse" if c.is_moe_layer(i) else "dense" for i in range(c.num_hidden_layers)],
        "linear_attn_config": {
            "full_attn_layers": [i + 1 for i in c.mla_layers],
            "kda_layers": [i + 1 for i in c.kda_layers],
            "num_heads": c.kda.num_heads,
            "head_dim": c.kda.head_dim,
            "short_conv_kernel_size": c.kda.conv_kernel,
        },
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_id,
        "pad_token_id": c.pad_token_id,
    }
    if c.kda.gate == KDAGate.LOWER_BOUND:
        out["linear_attn_config"]["gate_lower_bound"] = c.kda.gate_lower_bound
    if c.kda.full_rank_output_gate:
        out["linear_attn_config"]["use_full_rank_gate"] = True
    if c.mla.output_gate:
        out["mla_use_output_gate"] = True
    if c.attn_res_block_size is not None:
        out["attn_res_block_size"] = c.attn_res_block_size
    if c.moe.latent_size is not None:
        out["routed_expert_hidden_size"] = c.moe.latent_size
        out["latent_moe_use_norm"] = c.moe.latent_norm
    if c.hidden_act == Activation.SITU:
        out["activation_situ_beta"], out["activation_situ_linear_beta"] = c.situ_beta, c.situ_linear_beta
    if c.expert_quantization == "mxfp4":
        out["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["routed experts"], "weights": {"num_bits": 4, "group_size": 32, "type": "float"}}},
        }
    return out


def save_config(config: ModelConfig, path: str | Path, vision: VisionConfig | None = None) -> None:
    """Write `config` as an HF config.json (what config_from_hf reads back to an equal ModelConfig); with `vision`, in the
    multimodal release's layout (`kimi_k3`: the text config in `text_config`, the tower in `vision_config`)."""
    out = config_to_hf(config)
    if vision is not None:
        out = {"architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3", "text_config": out, "vision_config": vision_to_hf(vision)}
    Path(path).write_text(json.dumps(out, indent=2) + "\n")
