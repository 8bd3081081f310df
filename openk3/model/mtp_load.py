"""load_mtp: the release's multi-token-prediction layer (model/mtp.py) from a checkpoint folder, beside its target model.

Which tensors: model/release.py's "mtp" extras, numbered as DeepSeek-V3 numbers them (`model.layers.{n}.*` with n =
num_hidden_layers, with or without `language_model.`). Every one of them is read into the layer; one the layer has no
place for, or a tensor it lacks, is a CheckpointError naming it (as for the text model). What the layer is, read from
its tensors: gated MLA (`self_attn.kv_a_proj_with_mqa`) or KDA, routed experts (`block_sparse_moe.experts.*`, packed MXFP4
or dense) or a dense MLP, and whether it ships its own `embed_tokens` / `shared_head.head` (else the target's are used).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import cast

import torch
from torch import nn

from openk3.config import LayerKind
from openk3.config.hf import mtp_layer_count
from openk3.model.checkpoint import CheckpointError, checkpoint_names, has_packed_experts, iter_checkpoint
from openk3.model.model import K3ForCausalLM
from openk3.model.mtp import MTPLayer, mtp_block_config
from openk3.model.release import LAYER_RE, release_extras
from openk3.model.weights import cast_model, load_state_dict_into
from openk3.ops.registry import OpTarget

AT = "model.layers.0."  # where the layer sits in the holder load_state_dict_into reads


class _Holder(nn.Module):
    """The layer where load_state_dict_into looks for a decoder layer (`model.layers.0.*`), with the config it reads."""

    def __init__(self, layer: MTPLayer) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([layer])
        self.config = layer.config
        self.vision = None


def mtp_tensors(path: Path, target: K3ForCausalLM) -> tuple[str, dict[str, str]]:
    """(the prefix of the checkpoint's MTP layer, its tensors: checkpoint name -> name inside the layer)."""
    config = target.config
    declared = mtp_layer_count(path)
    extras = [n for n, kind in release_extras(checkpoint_names(path), config, declared).items() if kind == "mtp"]
    if not extras:
        raise CheckpointError(
            f"{path}: speculative method 'mtp' needs the checkpoint's multi-token-prediction layer; it has none (num_nextn_predict_layers={declared})"
        )
    layers: dict[str, dict[str, str]] = {}
    for name in extras:
        text = name.removeprefix("language_model.")
        m = LAYER_RE.match(text)
        if m is None:
            where = f"model.layers.{config.num_hidden_layers}.*, DeepSeek-V3's layout"
            raise CheckpointError(f"MTP tensor {name}: openk3 reads an MTP layer numbered after the decoder layers ({where})")
        layers.setdefault(name[: len(name) - len(text)] + m.group(0), {})[name] = text[m.end() :]
    if len(layers) != 1:
        raise CheckpointError(f"{path} has {len(layers)} MTP layers ({', '.join(sorted(layers))}); openk3 runs one (the K3 release ships one)")
    ((prefix, names),) = layers.items()
    return prefix, names


def load_mtp(path: str | Path, target: K3ForCausalLM) -> MTPLayer:
    """The checkpoint's MTP layer, on the target's device in its dtype (the router and KDA gate parameters in fp32, as
    cast_model keeps them), with the target's op choice ("auto" resolved for inference there); its embedding and head are
    the target's unless it ships its own."""
    path = Path(path)
    prefix, names = mtp_tensors(path, target)
    local = set(names.values())
    kind = LayerKind.MLA if any(n.startswith("self_attn.kv_a_proj_with_mqa.") for n in local) else LayerKind.KDA
    moe = any(n.startswith(("block_sparse_moe.experts.", "block_sparse_moe.gate.")) for n in local)
    block = mtp_block_config(target.config, kind, moe)
    layer_ops = dataclasses.replace(target.ops, packed_experts=has_packed_experts([AT + n for n in local]))
    weight = target.lm_head.weight
    with torch.device("meta"):
        layer = MTPLayer(block, target.model.embed_tokens, target.lm_head, layer_ops, "embed_tokens.weight" in local, "shared_head.head.weight" in local)
    layer.to_empty(device=weight.device)
    holder = _Holder(layer)
    tensors = ((AT + names[n], t) for n, t in iter_checkpoint(path, keep=names.__contains__))
    try:
        load_state_dict_into(cast(K3ForCausalLM, holder), tensors)  # reads only the holder's config, state_dict and vision
    except CheckpointError as err:
        raise CheckpointError(str(err).replace(AT, prefix)) from None
    cast_model(cast(K3ForCausalLM, holder), weight.dtype)
    layer.select_ops(layer_ops, OpTarget(weight.device.type, dtype=weight.dtype))
    return layer.eval()
