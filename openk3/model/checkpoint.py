"""Reading an HF-style checkpoint folder (config.json + model.safetensors or a sharded index; safetensors only): its files
and tensor names, the tensors themselves (optionally only a rank's block of a split tensor, or only its experts), and the
spelling rules that map an accepted checkpoint name onto this model's state-dict key. Loading into a model and its checks
are weights.py's.

Routed experts arrive one tensor per expert (`experts.{e}.w1.weight`, or gpt-oss style `_blocks` / `_scales`): EXPERT_RE
names their parts, STACKED_SUFFIX the stacked tensor each lands in.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from openk3.config import ModelConfig
from openk3.model.model import K3ForCausalLM

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
