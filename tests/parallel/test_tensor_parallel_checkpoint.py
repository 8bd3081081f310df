"""A tensor-parallel rank reads only its blocks of a checkpoint (safetensors slices) and ends up holding exactly the cut
of the whole model; the release's padded A_log and shape errors are handled on the full shapes. No process group is
needed: a sizing-only context cuts the model, and nothing here runs a collective."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from openk3.model import K3ForCausalLM, weights
from openk3.model.checkpoint import EXPERT_RE, STACKED_SUFFIX, CheckpointError, canonical_name
from openk3.model.weights import load_model, save_model
from openk3.parallel.group import ParallelContext
from openk3.parallel.tp.shard import TensorSplits, parallelize_tensor
from tests.parallel.tp_cases import model_of


def stacked_key(name: str, config) -> str:  # type: ignore[no-untyped-def]
    key = canonical_name(name, config)
    m = EXPERT_RE.match(key)
    return f"{m.group(1)}.{m.group(3)}{STACKED_SUFFIX[m.group(4)]}" if m else key


def load_rank(folder: Path, rank: int) -> tuple[torch.nn.Module, TensorSplits]:
    ctx = ParallelContext.for_sizing(rank, 2)
    splits: list[TensorSplits] = []

    def layout(model: K3ForCausalLM) -> TensorSplits:
        splits.append(parallelize_tensor(model, ctx, split_experts=True))
        return splits[0]

    return load_model(folder, layout=layout), splits[0]


@pytest.mark.parametrize("name", ["debug", "packed"])
def test_each_rank_reads_its_blocks_and_holds_the_cut(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    full = model_of(name)
    save_model(full, tmp_path)
    blocks: dict[str, tuple[int, int, int] | None] = {}
    reader = weights.slice_reader

    def recording(model, slices):  # type: ignore[no-untyped-def]
        part = reader(model, slices)

        def read(raw_name: str, shape):  # type: ignore[no-untyped-def]
            blocks[raw_name] = part(raw_name, shape)
            return blocks[raw_name]

        return read

    monkeypatch.setattr(weights, "slice_reader", recording)
    for rank in (0, 1):
        got, splits = load_rank(tmp_path, rank)
        want = copy.deepcopy(full)
        parallelize_tensor(want, ParallelContext.for_sizing(rank, 2), split_experts=True)
        got_sd, want_sd = got.state_dict(), want.state_dict()
        assert got_sd.keys() == want_sd.keys()
        for key, tensor in want_sd.items():
            assert torch.equal(got_sd[key], tensor), key
        split_names = {n for n in blocks if splits.dim_of(stacked_key(n, full.config)) is not None and not n.endswith("A_log")}
        assert split_names and {n for n, b in blocks.items() if b is not None} == split_names  # read as blocks, the rest whole
        assert all(b is not None and b[1] == rank * b[2] for n, b in blocks.items() if n in split_names)


def test_padded_a_log_of_the_release_is_fitted_then_cut(tmp_path: Path) -> None:
    full = model_of("debug")
    save_model(full, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    padded = {n: torch.cat([t, torch.zeros(6)]) if n.endswith("A_log") else t for n, t in tensors.items()}
    save_file(padded, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    got, _ = load_rank(tmp_path, 1)
    want = copy.deepcopy(full)
    parallelize_tensor(want, ParallelContext.for_sizing(1, 2), split_experts=True)
    for key, tensor in want.state_dict().items():
        assert torch.equal(got.state_dict()[key], tensor), key


def test_a_wrong_shape_is_reported_against_the_full_shape(tmp_path: Path) -> None:
    save_model(model_of("debug"), tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name][:-1]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"q_proj\.weight has shape \(31, 64\), expected \(32, 64\)"):
        load_rank(tmp_path, 0)
