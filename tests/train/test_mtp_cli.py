"""`openk3 train-mtp`'s shipping half: an MTP layer exported under the release's names as a shard of its own, the folder's
index regenerated over every shard (model/shard_index.py), the text model still loading from the folder and the layer
read back by load_mtp with the exported values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from openk3.config import debug
from openk3.model.mtp_load import load_mtp
from openk3.model.shard_index import INDEX, shard_index, write_index
from openk3.model.weights import load_model, save_model
from openk3.train.mtp_cli import MTP_SHARD, export_mtp
from openk3.train.mtp_head import new_mtp_layer
from tests.model.conftest import build


def test_the_exported_shard_is_indexed_and_read_back(tmp_path: Path) -> None:
    source = build(debug())
    source.quantize_experts()  # packed MXFP4 experts, as the demo model ships them
    save_model(source, tmp_path)
    target = load_model(tmp_path)
    layer = new_mtp_layer(target, seed=3)
    n = target.config.num_hidden_layers
    exported = export_mtp(layer, n)
    assert f"model.layers.{n}.eh_proj.weight" in exported and f"model.layers.{n}.block_sparse_moe.experts.0.w1.weight_packed" in exported
    save_file(exported, str(tmp_path / MTP_SHARD))
    index = json.loads(write_index(tmp_path).read_text())
    assert index["weight_map"] == {name: MTP_SHARD for name in exported} | {name: "model.safetensors" for name in json_keys(tmp_path / "model.safetensors")}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in exported.values()) + file_bytes(tmp_path / "model.safetensors")
    text = load_model(tmp_path)  # the text model reads its own tensors and skips the MTP layer's
    assert all(torch.equal(a, b) for a, b in zip(text.state_dict().values(), target.state_dict().values(), strict=True))
    back = load_mtp(tmp_path, target)
    for name, want in layer.state_dict().items():
        got = back.state_dict()[name]
        tol = 0 if ".gate." in name or not want.is_floating_point() else 1e-2  # bf16 in the shard, the router in fp32
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_a_tensor_in_two_shards_is_refused(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(2), "b": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    save_file({"a": torch.zeros(2)}, str(tmp_path / MTP_SHARD))
    with pytest.raises(ValueError, match="tensor a is in both"):
        shard_index(tmp_path)
    assert not (tmp_path / INDEX).exists()


def json_keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def file_bytes(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
