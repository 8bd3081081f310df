"""Checkpoint loading: round trips, accepted spellings, and errors that name the tensor and the expected shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from openk3.config import config_to_hf, debug, save_config
from openk3.model import CheckpointError, K3ForCausalLM, load_model, save_model
from openk3.model.weights import export_state_dict

from .conftest import build


def write(path: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_config(debug(), path / "config.json")
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return path
    weight_map = {}
    for s in range(shards):
        part = {n: tensors[n] for n in names[s::shards]}
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(path / fname))
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def same_logits(a: K3ForCausalLM, b: K3ForCausalLM) -> None:
    tokens = torch.randint(0, 256, (1, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(a.forward_tokens(tokens), b.forward_tokens(tokens), atol=0, rtol=0)


def test_save_load_round_trip(tmp_path: Path) -> None:
    model = build(debug())
    save_model(model, tmp_path / "ckpt")
    same_logits(model, load_model(tmp_path / "ckpt"))


def test_official_names_prefix_shards_and_transformers_spellings(tmp_path: Path) -> None:
    model = build(debug())
    tensors = export_state_dict(model)
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in tensors
    spelled = {}
    for name, t in tensors.items():
        if name.endswith("self_attn.A_log"):
            t = t.view(1, 1, -1, 1)  # transformers' layout
        if name.startswith("model.layers.0.mlp."):
            name = name.replace(".mlp.", ".block_sparse_moe.")  # transformers writes the dense first layer there
        spelled["language_model." + name] = t
    same_logits(model, load_model(write(tmp_path / "multi", spelled, shards=3)))


def test_mis_shaped_tensor_is_named_with_both_shapes(tmp_path: Path) -> None:
    tensors = export_state_dict(build(debug()))
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(31, 64)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight has shape \(31, 64\), expected \(32, 64\)"):
        load_model(write(tmp_path / "bad", tensors))


def test_missing_and_unexpected_tensors_are_named(tmp_path: Path) -> None:
    tensors = export_state_dict(build(debug()))
    del tensors["model.norm.weight"]
    del tensors["model.layers.2.block_sparse_moe.experts.3.w1.weight"]
    tensors["model.layers.0.self_attn.extra"] = torch.zeros(2)
    with pytest.raises(CheckpointError) as err:
        load_model(write(tmp_path / "bad", tensors))
    msg = str(err.value)
    assert "missing tensor model.norm.weight, expected shape (64,)" in msg
    assert "missing experts [3] of model.layers.2.block_sparse_moe.experts.w1" in msg
    assert "unexpected tensor model.layers.0.self_attn.extra" in msg


def test_pickle_only_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(debug())))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="safetensors only"):
        load_model(tmp_path)


def test_dtype_cast_keeps_router_and_gate_in_fp32(tmp_path: Path) -> None:
    save_model(build(debug()), tmp_path / "ckpt")
    model = load_model(tmp_path / "ckpt", dtype=torch.bfloat16)
    sd = model.state_dict()
    assert sd["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert sd["model.layers.1.block_sparse_moe.gate.weight"].dtype == torch.float32
    assert sd["model.layers.1.block_sparse_moe.gate.e_score_correction_bias"].dtype == torch.float32
    assert sd["model.layers.0.self_attn.dt_bias"].dtype == torch.float32


def test_multimodal_checkpoint_refuses_undeclared_towers_and_checks_weight_shape(tmp_path: Path) -> None:
    model = build(debug())
    model.quantize_experts()
    tensors = {"language_model." + n: t for n, t in export_state_dict(model).items()}
    tensors["language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight_shape"] = torch.tensor([32, 32])
    path = tmp_path / "mm"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "kimi_k3", "text_config": config_to_hf(model.config.replace(expert_quantization="mxfp4"))}))
    save_file(tensors, str(path / "model.safetensors"))
    same_logits(model, load_model(path))
    save_file(tensors | {"vision_tower.patch_embed.weight": torch.zeros(4, 4)}, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"unexpected tensor vision_tower\.patch_embed\.weight \(4, 4\) \(config.json declares no vision_config\)"):
        load_model(path)
    tensors["language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight_shape"] = torch.tensor([32, 64])
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"experts\.0\.w2\.weight_shape records dense shape \[32, 64\], expected \[32, 32\]"):
        load_model(path)


def test_training_through_the_inference_kda_names_the_fix() -> None:
    model = build(debug())
    with pytest.raises(RuntimeError, match="inference.*OpTarget\\(training=True\\)"):
        model.forward_tokens(torch.randint(0, 256, (1, 8)))
