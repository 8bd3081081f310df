"""Checkpoint loading and saving: HF-style folders (config.json + model.safetensors or a sharded index), safetensors only.

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
import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from openk3.config import ModelConfig, config_from_hf, save_config
from openk3.config.hf import mtp_layer_count, vision_config_from_hf
from openk3.model.model import K3ForCausalLM, OpChoice
from openk3.model.moe import DenseExperts, PackedExperts
from openk3.model.release import fit_a_log, log_extras, release_extras

EXPERT_SUFFIXES = "weight|weight_packed|weight_scale|weight_blocks|weight_scales|weight_shape"
EXPERT_RE = re.compile(rf"^(model\.layers\.\d+\.block_sparse_moe\.experts)\.(\d+)\.(w[123])\.({EXPERT_SUFFIXES})$")
# per-expert checkpoint suffix -> suffix of the stacked tensor in this model (gpt-oss `_blocks` are K3 `_packed` after a reshape)
STACKED_SUFFIX = {
    "weight": "",
    "weight_packed": "_weight_packed",
    "weight_scale": "_weight_scale",
    "weight_blocks": "_weight_packed",
    "weight_scales": "_weight_scale",
}
PACKED_SUFFIXES = ("weight_packed", "weight_blocks")
VISION_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
KEEP_FP32 = ("block_sparse_moe.gate.weight", "e_score_correction_bias", "self_attn.dt_bias", "self_attn.A_log")


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: the message names every offending tensor."""


class TensorSlices(Protocol):
    """A rank's part of a model split along one dimension per key: key -> dim (None: held whole); the rank holds block
    `index` of `parts` equal blocks of that dimension."""

    parts: int
    index: int

    def dim_of(self, key: str) -> int | None: ...


# (dim, start, length) of the block to read from a checkpoint tensor, or None to read it whole
ReadPart = Callable[[str, Sequence[int]], tuple[int, int, int] | None]


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


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    if list(path.glob("*.bin")) or list(path.glob("*.pt")):
        raise CheckpointError(f"{path} holds only pickle checkpoints (.bin/.pt); openk3 loads safetensors only")
    raise CheckpointError(f"{path} has neither model.safetensors nor model.safetensors.index.json")


def checkpoint_names(path: Path) -> list[str]:
    names: list[str] = []
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            names.extend(f.keys())
    return names


def has_packed_experts(names: list[str]) -> bool:
    return any((m := EXPERT_RE.match(n.removeprefix("language_model."))) and m.group(4) in PACKED_SUFFIXES for n in names)


def iter_checkpoint(path: Path, keep: Callable[[str], bool] | None = None, part: ReadPart | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor (name, value); with `keep`, tensors it refuses are skipped before they are read; with `part`, only the
    block it names is read of a tensor (given the tensor's name and its shape in the file)."""
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if keep is not None and not keep(name):
                    continue
                block = part(name, f.get_slice(name).get_shape()) if part is not None else None
                if block is None:
                    yield name, f.get_tensor(name)
                    continue
                dim, start, length = block
                index = [slice(None)] * len(f.get_slice(name).get_shape())
                index[dim] = slice(start, start + length)
                yield name, f.get_slice(name)[tuple(index)]


def slice_reader(model: K3ForCausalLM, slices: TensorSlices) -> ReadPart:
    """The `part` of iter_checkpoint for a model cut by `slices`: a split tensor whose shape in the file is the full shape
    is read as the rank's block; anything else whole (load_state_dict_into then cuts or reports it)."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    config = model.config

    def part(raw_name: str, file_shape: Sequence[int]) -> tuple[int, int, int] | None:
        name = canonical_name(raw_name, config)
        m = EXPERT_RE.match(name)
        if m is not None:
            if m.group(4) not in ("weight", "weight_packed", "weight_scale"):
                return None
            key, offset = f"{m.group(1)}.{m.group(3)}{STACKED_SUFFIX[m.group(4)]}", 1  # per-expert tensor: the stacked dims less one
        else:
            key, offset = name, 0
        dim = slices.dim_of(key)
        if dim is None or key not in expected or name.endswith("self_attn.A_log"):  # A_log may be padded: cut after fitting
            return None
        shape = expected[key][offset:]
        dim -= offset
        if len(file_shape) != len(shape) or file_shape[dim] != shape[dim] * slices.parts:
            return None
        return dim, slices.index * shape[dim], shape[dim]

    return part


ExpertIds = Mapping[int, Sequence[int]]  # MoE layer index -> the global expert ids this process keeps, in bank order


def expert_filter(experts: ExpertIds) -> Callable[[str], bool]:
    """A `keep` for iter_checkpoint: drops the per-expert tensors of listed layers whose expert is not listed."""
    wanted = {layer: {int(e) for e in ids} for layer, ids in experts.items()}

    def keep(name: str) -> bool:
        m = EXPERT_RE.match(name.removeprefix("language_model."))
        if m is None:
            return True
        layer = int(m.group(1).split(".")[2])
        return layer not in wanted or int(m.group(2)) in wanted[layer]

    return keep


def check_expert_ids(experts: ExpertIds, num_experts: int) -> None:
    """Every listed id is a real expert. A layer may list one id twice (each row gets a copy of that expert's tensors)."""
    for layer, ids in experts.items():
        if not ids:
            raise ValueError(f"experts: layer {layer} lists no expert; expected at least one id in 0..{num_experts - 1}")
        bad = [int(e) for e in ids if not 0 <= int(e) < num_experts]
        if bad:
            raise ValueError(f"experts: layer {layer} lists expert id {bad[0]}, expected ids in 0..{num_experts - 1}")


def rows_by_expert(ids: Sequence[int]) -> dict[int, list[int]]:
    """Global expert id -> every bank row that holds it (a placement may give one rank two replicas of an expert)."""
    rows: dict[int, list[int]] = {}
    for row, e in enumerate(ids):
        rows.setdefault(int(e), []).append(row)
    return rows


def canonical_name(name: str, config: ModelConfig) -> str:
    """Map any accepted spelling onto this model's state-dict key (experts still per expert)."""
    if name.startswith("language_model."):
        name = name[len("language_model.") :]
    m = re.match(r"^model\.layers\.(\d+)\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.weight$", name)
    if m and not config.is_moe_layer(int(m.group(1))):
        name = f"model.layers.{m.group(1)}.mlp.{m.group(2)}.weight"
    if re.search(r"_res_(proj|norm)$", name):
        name += ".weight"
    return name


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
