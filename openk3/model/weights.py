"""Checkpoint loading and saving: HF-style folders (config.json + model.safetensors or a sharded index), safetensors only
(the folder's files, names and tensors, a rank's slices and experts, and the name spellings are read by checkpoint.py).

Accepted tensor names: the official K3/Kimi-Linear names (with or without the multimodal `language_model.` prefix),
what transformers' Kimi-Linear port writes (A_log as [1, 1, H, 1]; the dense first layer under `block_sparse_moe.`), and
the release's vision tower and projector (`vision_tower.*`, `mm_projector.*`) when config.json declares a vision_config.
The K3 release's quirks (zero-padded A_log, its multi-token-prediction layers) are model/release.py's; any other tensor
this model lacks is an error (a vision tensor in a folder whose config.json has no vision_config among them).
Routed experts arrive one tensor per expert (`experts.{e}.w1.weight`) and are stacked per layer here ([E, I, D]).
Every problem is reported with the tensor's name, its shape and the expected shape; nothing is loaded half-way.
An expert-parallel rank loads only its own experts (`load_model(..., experts={layer: global ids})`): the other experts'
tensors are never read, and that layer's bank holds just the listed experts, in list order. A tensor-parallel rank reads
only its block of each split tensor (`load_model(..., layout=...)`: the layout cuts the model on the meta device and says
which keys it split along which dimension; safetensors' slices read just those rows or columns).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from openk3.config import config_from_hf, save_config
from openk3.config.hf import mtp_layer_count, vision_config_from_hf
from openk3.model.checkpoint import (
    EXPERT_RE,
    STACKED_SUFFIX,
    CheckpointError,
    ExpertIds,
    TensorSlices,
    canonical_name,
    check_expert_ids,
    checkpoint_names,
    expert_filter,
    has_packed_experts,
    iter_checkpoint,
    rows_by_expert,
    slice_reader,
)
from openk3.model.model import K3ForCausalLM, OpChoice
from openk3.model.moe import DenseExperts, PackedExperts
from openk3.model.release import fit_a_log, log_extras, release_extras

VISION_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
KEEP_FP32 = ("block_sparse_moe.gate.weight", "e_score_correction_bias", "self_attn.dt_bias", "self_attn.A_log")


def _rank_block(tensor: torch.Tensor, shape: Sequence[int], dim: int | None, slices: TensorSlices | None) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(the rank's block of `tensor` when it was read whole, the full shape the checkpoint must have) for a model tensor of
    `shape` split along `dim`."""
    if slices is None or dim is None:
        return tensor, tuple(shape)
    full = list(shape)
    full[dim] *= slices.parts
    if tensor.dim() == len(full) and tensor.shape[dim] == full[dim]:
        tensor = tensor.narrow(dim, slices.index * shape[dim], shape[dim])
    return tensor, tuple(full)


def load_state_dict_into(
    model: K3ForCausalLM, tensors: Iterator[tuple[str, torch.Tensor]], experts: ExpertIds | None = None, slices: TensorSlices | None = None
) -> None:
    """Copy checkpoint tensors into the model's (already allocated) parameters and buffers, checking every name and shape
    (tensors that are not part of the model, release_extras, are filtered out before, by load_model).

    `experts`: listed layers' banks hold only those experts (global id ids[i] goes to row i, to every such row when an id
    is listed twice); other experts are skipped. `slices`: the model holds blocks of the keys it lists; a tensor that
    arrives whole is cut to the block, and shapes are checked against the full (unsplit) shape."""
    config = model.config
    rows_of = {layer: rows_by_expert(ids) for layer, ids in (experts or {}).items()}
    expected = dict(model.state_dict())
    filled: set[str] = set()
    expert_seen: dict[str, set[int]] = {}
    problems: list[str] = []
    with torch.no_grad():
        for raw_name, tensor in tensors:
            name = canonical_name(raw_name, config)
            m = EXPERT_RE.match(name)
            if m and m.group(4) == "weight_shape":
                problems.extend(_check_weight_shape(raw_name, tensor, expected, m.group(1), m.group(3)))
                continue
            if m:
                key = f"{m.group(1)}.{m.group(3)}{STACKED_SUFFIX[m.group(4)]}"
                if key not in expected:
                    problems.append(f"unexpected tensor {raw_name} {tuple(tensor.shape)}")
                    continue
                e = int(m.group(2))
                layer = int(m.group(1).split(".")[2])
                if layer in rows_of:
                    if e not in rows_of[layer]:
                        continue  # another rank's expert
                    rows = rows_of[layer][e]
                else:
                    rows = [e]
                target = expected[key]
                if m.group(4) == "weight_blocks":
                    tensor = tensor.reshape(tensor.shape[0], -1)  # [rows, K/32, 16] -> [rows, K/2], same nibble order
                if tensor.dtype in (torch.int8, torch.float8_e8m0fnu) and target.dtype == torch.uint8:
                    tensor = tensor.view(torch.uint8)  # packed codes and E8M0 scales are raw bytes whatever the file calls them
                dim = slices.dim_of(key) if slices is not None else None
                tensor, full = _rank_block(tensor, target.shape[1:], dim - 1 if dim is not None else None, slices)
                if (layer not in rows_of and not 0 <= e < target.shape[0]) or tuple(tensor.shape) != tuple(target.shape[1:]):
                    problems.append(f"tensor {raw_name} has shape {tuple(tensor.shape)}, expected {full} (expert < {target.shape[0]})")
                    continue
                for row in rows:
                    target[row].copy_(tensor)
                expert_seen.setdefault(key, set()).update(rows)
                continue
            if name not in expected:
                hint = " (config.json declares no vision_config)" if model.vision is None and name.startswith(VISION_PREFIXES) else ""
                problems.append(f"unexpected tensor {raw_name} {tuple(tensor.shape)}{hint}")
                continue
            target = expected[name]
            dim = slices.dim_of(name) if slices is not None else None
            if name.endswith("self_attn.A_log"):
                full_shape = _rank_block(target, target.shape, dim, slices)[1]
                tensor, problem = fit_a_log(raw_name, tensor, torch.empty(full_shape, device="meta"))
                if problem:
                    problems.append(problem)
                    continue
            tensor, full = _rank_block(tensor, target.shape, dim, slices)
            if tuple(tensor.shape) != tuple(target.shape):
                problems.append(f"tensor {raw_name} has shape {tuple(tensor.shape)}, expected {full}")
                continue
            target.copy_(tensor)
            filled.add(name)
    for key, seen in expert_seen.items():
        missing = sorted(set(range(expected[key].shape[0])) - seen)
        ids = (experts or {}).get(int(key.split(".")[2]))
        if missing and ids is not None:
            missing = sorted({int(ids[row]) for row in missing})  # report global ids, as the checkpoint names them
        if missing:
            problems.append(f"missing experts {missing[:8]}{'...' if len(missing) > 8 else ''} of {key} (expected {expected[key].shape[0]})")
        filled.add(key)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    for name in sorted(set(expected) - filled - tied):
        problems.append(f"missing tensor {name}, expected shape {tuple(expected[name].shape)}")
    if problems:
        raise CheckpointError("checkpoint does not match the model:\n  " + "\n  ".join(problems))


def _check_weight_shape(raw_name: str, tensor: torch.Tensor, expected: dict[str, torch.Tensor], experts: str, w: str) -> list[str]:
    """compressed-tensors records each packed weight's dense [rows, cols]; it must agree with this model's expert shape."""
    if f"{experts}.{w}_weight_packed" in expected:
        rows, half = expected[f"{experts}.{w}_weight_packed"].shape[1:]
        dense = [int(rows), 2 * int(half)]
    elif f"{experts}.{w}" in expected:
        dense = [int(d) for d in expected[f"{experts}.{w}"].shape[1:]]
    else:
        return [f"unexpected tensor {raw_name} {tuple(tensor.shape)}"]
    if tensor.flatten().tolist() != dense:
        return [f"tensor {raw_name} records dense shape {tensor.flatten().tolist()}, expected {dense}"]
    return []


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    ops: OpChoice | None = None,
    experts: ExpertIds | None = None,
    layout: Callable[[K3ForCausalLM], TensorSlices] | None = None,
    mtp: bool = False,
) -> K3ForCausalLM:
    """Build the model described by `path/config.json` and load its safetensors weights (the public entry point).

    `experts` (expert parallelism): per MoE layer, the global ids of the experts this process holds; those layers' banks
    are allocated with just these experts and the rest are never read. Such a model is only correct with an expert
    backend that knows the ids (openk3.parallel.serving.rank_model).
    `layout` (tensor parallelism): called on the model while it is still on the meta device, it cuts the model to one
    rank's part and returns what it split (openk3.parallel.tp.shard); only those blocks are read.
    `mtp`: the caller reads the multi-token-prediction layer itself (model/mtp_load.py), so it is not logged as skipped."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise CheckpointError(f"{path} has no config.json")
    config = config_from_hf(path)
    vision = vision_config_from_hf(path)
    all_names = checkpoint_names(path)
    extras = release_extras(all_names, config, mtp_layer_count(path))
    if not mtp:
        log_extras(extras, config)
    names = [n for n in all_names if n not in extras]
    ops = dataclasses.replace(ops or OpChoice(), packed_experts=has_packed_experts(names))
    with torch.device("meta"):
        model = K3ForCausalLM(config, ops, vision)
        if experts is not None:
            check_expert_ids(experts, config.moe.num_experts)
            keep_expert_slots(model, {layer: len(ids) for layer, ids in experts.items()})
        slices = layout(model) if layout is not None else None
    model = model.to_empty(device=device)
    expert_keep = expert_filter(experts) if experts is not None else None

    def keep(name: str) -> bool:  # the release's extras are never read
        return name not in extras and (expert_keep is None or expert_keep(name))

    part = slice_reader(model, slices) if slices is not None else None
    load_state_dict_into(model, iter_checkpoint(path, keep, part), experts=experts, slices=slices)
    cast_model(model, dtype)
    return model.eval()


def keep_expert_slots(model: K3ForCausalLM, counts: Mapping[int, int]) -> None:
    """Give the listed MoE layers an uninitialised bank of `counts[layer]` experts (same storage kind as before)."""
    moe_by_index = {moe.layer_index: moe for moe in model.moe_layers()}
    unknown = sorted(set(counts) - set(moe_by_index))
    if unknown:
        raise ValueError(f"experts: layers {unknown} are not MoE layers (MoE layers: {sorted(moe_by_index)})")
    width = model.config.moe.latent_size or model.config.hidden_size
    inter = model.config.moe.moe_intermediate_size
    for layer, n in counts.items():
        moe = moe_by_index[layer]
        kind = PackedExperts if isinstance(moe.experts, PackedExperts) else DenseExperts
        moe.experts = kind(n, width, inter)


def cast_model(model: K3ForCausalLM, dtype: torch.dtype) -> None:
    """Cast to `dtype`, keeping the router, its bias and the KDA gate parameters in fp32 as the checkpoint does
    (packed MXFP4 experts are bytes and stay as they are)."""
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if p.is_floating_point():
            p.data = p.data.to(torch.float32 if name.endswith(KEEP_FP32) else dtype)


def export_state_dict(model: K3ForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under the official checkpoint names (experts split per expert)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        m = re.match(r"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(w[123])(_weight_packed|_weight_scale)?$", name)
        if m:
            suffix = (m.group(3) or "_weight")[1:]
            for e in range(tensor.shape[0]):
                out[f"{m.group(1)}.{e}.{m.group(2)}.{suffix}"] = tensor[e].contiguous()
        elif not (model.config.tie_word_embeddings and name == "lm_head.weight"):
            out[name] = tensor.contiguous()
    return out


def save_model(model: K3ForCausalLM, path: str | Path) -> None:
    """Write config.json + model.safetensors in the layout `load_model` (and the official loaders) read."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    packed = any(isinstance(moe.experts, PackedExperts) for moe in model.moe_layers())
    config = model.config.replace(expert_quantization="mxfp4") if packed else model.config
    save_config(config, path / "config.json", model.vision)
    save_file(export_state_dict(model), str(path / "model.safetensors"), metadata={"format": "pt"})
