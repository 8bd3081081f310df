"""load_eagle3: an EAGLE-3 draft head (model/eagle3.py) from its checkpoint folder, beside the target it drafts for.

The folder is what EAGLE-3 trainers publish (SafeAILab/EAGLE, SpecForge, and the Kimi K2/K2.5/K2.6 heads in that layout):
config.json with `architectures` LlamaForCausalLMEagle3 (or Eagle3LlamaForCausalLM), the head's Llama dimensions,
`draft_vocab_size`, optionally `target_hidden_size`, `norm_before_residual`, `rope_scaling` (Llama 3.1's "llama3") and the
aux layer ids (`eagle_aux_hidden_state_layer_ids`, top level or under `eagle_config`; default [2, L // 2, L - 3] of the
target's L layers, used as vLLM uses them: id i is the hidden state entering the target's layer i); and model.safetensors
(or an index) with `fc.weight`, `midlayer.*` (or `layers.0.*`), `norm.weight`, `lm_head.weight`, `d2t`, `t2d` and an optional
`embed_tokens.weight`. Every config key is read or refused (a few metadata keys that change nothing are listed), every
tensor placed; a missing, unknown or misshapen tensor is a CheckpointError naming it. Multi-layer heads are refused by
name; the MLA-layer heads are model/eagle3_mla_load.py's (load_any_eagle3 picks by architecture): docs/serving.md says
which published drafts load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from openk3.config import ModelConfig
from openk3.model.checkpoint import CheckpointError, iter_checkpoint
from openk3.model.eagle3 import Eagle3Config, Eagle3Head, rope_frequencies
from openk3.model.eagle3_mla import AnyEagle3Head
from openk3.model.model import K3ForCausalLM
from openk3.ops.registry import OpTarget

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# keys of a published config.json that change nothing in the forward (names, dtypes, token ids, training settings)
METADATA = frozenset(
    {
        "model_type", "torch_dtype", "dtype", "transformers_version", "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
        "use_cache", "pretraining_tp", "max_position_embeddings", "_name_or_path", "attention_dropout", "num_hidden_layers", "architectures",
    }
)  # fmt: skip
READ = frozenset(
    {
        "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "draft_vocab_size",
        "target_hidden_size", "rms_norm_eps", "rope_theta", "rope_scaling", "norm_before_residual", "hidden_act", "tie_word_embeddings",
        "attention_bias", "mlp_bias", "eagle_config", "eagle_aux_hidden_state_layer_ids", "use_sliding_window", "sliding_window",
        "max_window_layers",
    }
)  # fmt: skip
EAGLE_CONFIG_KEYS = frozenset(
    {"eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state", "use_input_layernorm_in_first_layer", "use_last_layernorm", "use_mtp_layernorm"}
)


def _refuse(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path}/config.json: {what}")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default: a low, a middle and a high layer (vLLM's and SGLang's [2, L // 2, L - 3])."""
    return (2, num_layers // 2, num_layers - 3)


def _aux_ids(path: Path, raw: dict[str, Any], target: ModelConfig) -> tuple[int, ...]:
    nested = raw.get("eagle_config") or {}
    if not isinstance(nested, dict):
        raise _refuse(path, f"eagle_config={nested!r} is not an object")
    if unknown := sorted(set(nested) - EAGLE_CONFIG_KEYS):
        raise _refuse(path, f"eagle_config keys {unknown} are not read by openk3 (it reads {sorted(EAGLE_CONFIG_KEYS)})")
    for key in ("use_aux_hidden_state", "use_input_layernorm_in_first_layer", "use_last_layernorm"):
        if nested.get(key, True) is not True:
            raise _refuse(path, f"eagle_config.{key}={nested[key]!r}: openk3 runs EAGLE-3's layout, where it is true")
    if nested.get("use_mtp_layernorm", False) is not False:  # TorchSpec's K3 MLA config writes it false
        raise _refuse(path, f"eagle_config.use_mtp_layernorm={nested['use_mtp_layernorm']!r}: openk3 runs EAGLE-3's layout, where it is false")
    ids = nested.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
    n = target.num_hidden_layers
    aux = default_aux_layers(n) if ids is None else tuple(ids)
    if len(aux) != 3 or any(not isinstance(i, int) or not 1 <= i < n for i in aux):
        where = "default [2, L // 2, L - 3]" if ids is None else "eagle_aux_hidden_state_layer_ids"
        raise _refuse(path, f"aux layer ids {list(aux)} ({where}) must be three layer ids in [1, {n - 1}] of the target's {n} layers")
    return aux


def _rope_llama3(path: Path, scaling: Any) -> tuple[float, float, float, int] | None:
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind == "default":
        return None
    if kind != "llama3":
        raise _refuse(path, f"rope_scaling={scaling!r}: openk3's EAGLE-3 head applies none, 'default' or 'llama3'")
    return (float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"]), int(scaling["original_max_position_embeddings"]))


def eagle3_config(path: Path, target: ModelConfig) -> Eagle3Config:
    """The head's config from `path`/config.json, checked against the target it drafts for."""
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path}: no config.json (an EAGLE-3 head folder has config.json and model.safetensors)")
    raw = json.loads(file.read_text())
    arch = raw.get("architectures") or []
    if not any(a in ARCHITECTURES for a in arch):
        hint = (
            " (an EAGLE-3 head with an MLA draft layer: model/eagle3_mla_load.py load_any_eagle3 reads the K3 NoPE one)"
            if any("Deepseek" in a or "MLA" in a for a in arch)
            else ""
        )
        raise _refuse(path, f"architectures={arch}{hint}; openk3 loads EAGLE-3 heads of {list(ARCHITECTURES)}")
    if unknown := sorted(set(raw) - READ - METADATA):
        raise _refuse(path, f"keys {unknown} are not read by openk3's EAGLE-3 loader")
    if raw.get("num_hidden_layers", 1) != 1:
        raise _refuse(path, f"num_hidden_layers={raw['num_hidden_layers']}: openk3 runs one-layer EAGLE-3 heads")
    checks = (("hidden_act", "silu"), ("tie_word_embeddings", False), ("attention_bias", False), ("mlp_bias", False), ("use_sliding_window", False))
    for key, want in checks:  # sliding_window and max_window_layers (Qwen2 fields some heads carry) matter only with it
        if raw.get(key, want) != want:
            raise _refuse(path, f"{key}={raw[key]!r}: openk3's EAGLE-3 head supports {want!r} only")
    if raw.get("vocab_size") != target.vocab_size:
        raise _refuse(path, f"vocab_size={raw.get('vocab_size')!r} differs from the target's {target.vocab_size}: the head drafts for another tokenizer")
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    target_hidden = raw.get("target_hidden_size") or hidden
    if target_hidden != target.hidden_size:
        raise _refuse(path, f"target_hidden_size={target_hidden} differs from the target's hidden_size={target.hidden_size}")
    try:
        return Eagle3Config(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            intermediate_size=raw["intermediate_size"],
            vocab_size=raw["vocab_size"],
            draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
            target_hidden_size=target_hidden,
            aux_layer_ids=_aux_ids(path, raw, target),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rope_llama3=_rope_llama3(path, raw.get("rope_scaling")),
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
        )
    except (KeyError, ValueError) as err:
        raise _refuse(path, f"{err}") from None


def _local_name(name: str) -> str:
    """The head's own name of a checkpoint tensor (`layers.0.*` as some trainers write the decoder layer is `midlayer.*`)."""
    for prefix in ("model.layers.0.", "layers.0."):
        if name.startswith(prefix):
            return "midlayer." + name[len(prefix) :]
    return name.removeprefix("model.") if name.startswith("model.") and not name.startswith("model.layers.") else name


def check_vocab_map(head: AnyEagle3Head, path: Path, has_t2d: bool) -> None:
    """d2t maps the draft ids to distinct target ids; t2d, where shipped, marks exactly those."""
    cfg = head.config
    ids = torch.arange(cfg.draft_vocab_size, device=head.d2t.device) + head.d2t
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab_size or len(torch.unique(ids)) != cfg.draft_vocab_size:
        raise CheckpointError(f"{path}: d2t maps the {cfg.draft_vocab_size} draft ids outside [0, {cfg.vocab_size}) or onto one target id twice")
    if has_t2d and (int(head.t2d.sum()) != cfg.draft_vocab_size or not bool(head.t2d[ids].all())):
        raise CheckpointError(f"{path}: t2d marks {int(head.t2d.sum())} target ids, not the {cfg.draft_vocab_size} that d2t maps the draft ids to")


def place_tensors(head: AnyEagle3Head, tensors: dict[str, tuple[str, torch.Tensor]], path: Path, dtype: torch.dtype, what: str, unknown: str) -> None:
    """Copy a head's checkpoint tensors (local name -> (checkpoint name, tensor)) into it and cast it to `dtype`, all or
    nothing: a tensor it has no place for (`unknown` says why), one it lacks (d2t / t2d may be left out when the draft
    vocabulary is the target's) or one of another shape is a CheckpointError naming every such tensor."""
    cfg = head.config
    expected = head.state_dict()
    problems = [f"{orig}: {unknown}" for local, (orig, _) in tensors.items() if local not in expected]
    optional = {"d2t", "t2d"} if cfg.draft_vocab_size == cfg.vocab_size else set()
    problems += [f"{name}: missing" for name in expected if name not in tensors and name not in optional]
    for local, (orig, t) in tensors.items():
        want = expected.get(local)
        if want is not None and tuple(t.shape) != tuple(want.shape):
            problems.append(f"{orig}: shape {tuple(t.shape)}, expected {tuple(want.shape)}")
    if problems:
        raise CheckpointError(f"{path}: {what} tensors do not match its config: " + "; ".join(problems))
    with torch.no_grad():
        for local, (_, t) in tensors.items():
            dest = expected[local]
            dest.copy_(t.to(dest.dtype) if not dest.is_floating_point() else t.to(dtype))
    head.to(dtype)  # floating tensors only: d2t / t2d keep their integer and bool types


def load_eagle3(path: str | Path, target: K3ForCausalLM) -> Eagle3Head:
    """The head on the target's device in its dtype, its embedding the target's unless it ships its own."""
    path = Path(path)
    cfg = eagle3_config(path, target.config)
    tensors = {_local_name(n): (n, t) for n, t in iter_checkpoint(path)}
    weight = target.lm_head.weight
    head = Eagle3Head(cfg, target.model.embed_tokens, own_embedding="embed_tokens.weight" in tensors).to(weight.device)
    place_tensors(head, tensors, path, weight.dtype, "EAGLE-3 head", "not part of an EAGLE-3 head")
    head.inv_freq = rope_frequencies(cfg).to(weight.device)  # RoPE's frequencies stay fp32
    check_vocab_map(head, path, "t2d" in tensors)
    head.select_ops(OpTarget(weight.device.type, dtype=weight.dtype))
    return head.eval()
