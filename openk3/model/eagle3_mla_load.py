"""load_eagle3_mla: a K3 EAGLE-3 draft head with one NoPE gated-MLA layer (model/eagle3_mla.py) from its checkpoint
folder; load_any_eagle3 picks it or the Llama-layer loader (model/eagle3_load.py) by the config's architecture.

The layout is the one TorchSpec's Kimi-K3 draft config writes (configs/draft_models/kimi_k3_eagle3_mla.json, the recipe of
lightseekorg/kimi-k3-eagle3-mla): `architectures` Eagle3DeepseekV2ForCausalLM with `mla_use_nope: true`, DeepSeek MLA
dimensions (`num_attention_heads` = `num_key_value_heads`, `q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`,
`qk_rope_head_dim`, `v_head_dim`), `mla_use_output_gate` and SiTU `hidden_act` as NeMo Automodel's KimiK3Eagle3DraftModel
adds them, `fc_norm` (EAGLE 3.1), and the aux layer ids where the Llama heads keep them. Tensors are the Llama heads' names
with the MLA layer's (`fc`, `fc_norm.{i}`, `midlayer.*` or `layers.0.*`, `norm`, `lm_head`, `d2t`, `t2d`, optional
`embed_tokens`; a `model.` prefix as NeMo saves them is dropped). Every key is read or refused, every tensor placed; a
missing, unknown or misshapen tensor is a CheckpointError naming it. A DeepSeek MLA draft with RoPE (the K2.x
`*-eagle3-mla` heads: `mla_use_nope` false) and the RoPE + sliding-window K3 variant (Eagle3DeepseekV2SWAForCausalLM) are
refused by name: openk3 builds no rotary or windowed MLA layer.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from openk3.config import Activation, MLAConfig, ModelConfig
from openk3.model.checkpoint import CheckpointError, iter_checkpoint
from openk3.model.eagle3_load import METADATA, _aux_ids, _local_name, _refuse, check_vocab_map, load_eagle3, place_tensors
from openk3.model.eagle3_mla import AnyEagle3Head, Eagle3MLAConfig, Eagle3MLAHead
from openk3.model.model import K3ForCausalLM
from openk3.ops.registry import OpTarget

MLA_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM",)
REFUSED = {
    "Eagle3DeepseekV2SWAForCausalLM": "the K3 EAGLE-3 variant with a RoPE, sliding-window (2048) MLA layer: openk3 builds no rotary or windowed MLA layer",
}
READ = frozenset(
    {
        "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
        "qk_rope_head_dim", "v_head_dim", "mla_use_nope", "mla_use_output_gate", "hidden_act", "activation_situ_beta", "activation_situ_linear_beta",
        "rms_norm_eps", "vocab_size", "draft_vocab_size", "target_hidden_size", "num_aux_hidden_states", "fc_norm", "eagle_config",
        "eagle_aux_hidden_state_layer_ids", "rope_scaling", "rope_theta", "tie_word_embeddings", "attention_bias", "mlp_bias",
    }
)  # fmt: skip
# rope_theta changes nothing under NoPE (no rotation); rope_scaling only through the YaRN softmax scale (_softmax_scale)


def _softmax_scale(path: Path, scaling: Any, qk_head_dim: int) -> float | None:
    """None (qk_head_dim^-1/2) without rope_scaling; with a yarn one, DeepSeek-V3's scale times mscale^2 (as TorchSpec's and
    vLLM's DeepSeek MLA drafts compute it from the same block): mscale = 0.1 * mscale_all_dim * ln(factor) + 1."""
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind == "default":
        return None
    if kind != "yarn":
        raise _refuse(path, f"rope_scaling={scaling!r}: a NoPE MLA head reads none, 'default' or 'yarn' (for its softmax scale only)")
    factor, all_dim = float(scaling.get("factor", 1.0)), float(scaling.get("mscale_all_dim", 0.0))
    mscale = 1.0 if factor <= 1 or not all_dim else 0.1 * all_dim * math.log(factor) + 1.0
    return mscale * mscale / math.sqrt(qk_head_dim)


def _check_fixed(path: Path, raw: dict[str, Any]) -> None:
    if raw.get("num_hidden_layers", 1) != 1:
        raise _refuse(path, f"num_hidden_layers={raw['num_hidden_layers']}: openk3 runs one-layer EAGLE-3 heads")
    if raw.get("mla_use_nope") is not True:
        raise _refuse(
            path,
            f"mla_use_nope={raw.get('mla_use_nope')!r}: a DeepSeek MLA draft layer with RoPE (the K2.x *-eagle3-mla heads) is not built; "
            "openk3 loads the K3 NoPE MLA head (mla_use_nope: true)",
        )
    for key, want in (("tie_word_embeddings", False), ("attention_bias", False), ("mlp_bias", False), ("num_aux_hidden_states", 3)):
        if raw.get(key, want) != want:
            raise _refuse(path, f"{key}={raw[key]!r}: openk3's K3 EAGLE-3 MLA head supports {want!r} only")
    heads = raw["num_attention_heads"]
    if raw.get("num_key_value_heads", heads) != heads:
        raise _refuse(path, f"num_key_value_heads={raw['num_key_value_heads']} differs from num_attention_heads={heads}: MLA has one per query head")


def eagle3_mla_config(path: Path, raw: dict[str, Any], target: ModelConfig) -> Eagle3MLAConfig:
    """The head's config from the parsed config.json, checked against the target it drafts for."""
    if unknown := sorted(set(raw) - READ - METADATA):
        raise _refuse(path, f"keys {unknown} are not read by openk3's K3 EAGLE-3 MLA loader")
    try:
        _check_fixed(path, raw)
        if raw.get("vocab_size") != target.vocab_size:
            raise _refuse(path, f"vocab_size={raw.get('vocab_size')!r} differs from the target's {target.vocab_size}: the head drafts for another tokenizer")
        hidden = raw["hidden_size"]
        target_hidden = raw.get("target_hidden_size") or hidden
        if target_hidden != target.hidden_size:
            raise _refuse(path, f"target_hidden_size={target_hidden} differs from the target's hidden_size={target.hidden_size}")
        mla = MLAConfig(
            num_heads=raw["num_attention_heads"],
            q_lora_rank=raw.get("q_lora_rank"),
            kv_lora_rank=raw["kv_lora_rank"],
            qk_nope_head_dim=raw["qk_nope_head_dim"],
            qk_rope_head_dim=raw["qk_rope_head_dim"],
            v_head_dim=raw["v_head_dim"],
            output_gate=bool(raw.get("mla_use_output_gate", False)),
        )
        act = raw.get("hidden_act", "silu")
        if act not in (Activation.SILU.value, Activation.SITU.value):
            raise _refuse(path, f"hidden_act={act!r}: the head's MLP is 'silu' or K3's 'situ'")
        return Eagle3MLAConfig(
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            vocab_size=raw["vocab_size"],
            draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
            target_hidden_size=target_hidden,
            aux_layer_ids=_aux_ids(path, raw, target),
            mla=mla,
            activation=Activation(act),
            situ_beta=float(raw.get("activation_situ_beta", 4.0)),
            situ_linear_beta=float(raw.get("activation_situ_linear_beta", 25.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            softmax_scale=_softmax_scale(path, raw.get("rope_scaling"), mla.qk_head_dim),
            fc_norm=bool(raw.get("fc_norm", False)),
        )
    except (KeyError, ValueError) as err:
        raise _refuse(path, f"{err}") from None


def load_eagle3_mla(path: str | Path, target: K3ForCausalLM) -> Eagle3MLAHead:
    """The head on the target's device in its dtype, its embedding the target's unless it ships its own."""
    path = Path(path)
    cfg = eagle3_mla_config(path, json.loads((path / "config.json").read_text()), target.config)
    tensors = {_local_name(n): (n, t) for n, t in iter_checkpoint(path)}
    weight = target.lm_head.weight
    head = Eagle3MLAHead(cfg, target.config, target.model.embed_tokens, own_embedding="embed_tokens.weight" in tensors).to(weight.device)
    unknown = "not part of this K3 EAGLE-3 MLA head (mla_use_output_gate / fc_norm say which tensors it has)"
    place_tensors(head, tensors, path, weight.dtype, "K3 EAGLE-3 MLA head", unknown)
    check_vocab_map(head, path, "t2d" in tensors)
    head.select_ops(OpTarget(weight.device.type, dtype=weight.dtype))
    return head.eval()


def load_any_eagle3(path: str | Path, target: K3ForCausalLM) -> AnyEagle3Head:
    """The EAGLE-3 head the folder's config.json names: the K3 NoPE MLA layer or the Llama layer (model/eagle3_load.py)."""
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path}: no config.json (an EAGLE-3 head folder has config.json and model.safetensors)")
    arch = json.loads(file.read_text()).get("architectures") or []
    for name in arch:
        if name in REFUSED:
            raise _refuse(path, f"architectures={arch}: {REFUSED[name]}")
    if any(a in MLA_ARCHITECTURES for a in arch):
        return load_eagle3_mla(path, target)
    return load_eagle3(path, target)
