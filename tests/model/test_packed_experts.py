"""Packed MXFP4 experts inside the model: same logits as the dequantised weights materialised, K3 checkpoint layout in and out."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch
from safetensors import safe_open

from openk3.cli import main
from openk3.config import debug, save_config
from openk3.model import load_model, save_model
from openk3.model.moe import DenseExperts, LocalExperts, PackedExperts
from openk3.ops.cpu.build import kernels_available
from openk3.ops.moe.bank import DenseExpertBank
from openk3.ops.moe.packed_bank import PackedMXFP4ExpertBank, dense_bank_nbytes

from .conftest import build

TOKENS = torch.randint(0, 256, (2, 21), generator=torch.Generator().manual_seed(0))


def dequantised_copy(packed_model):
    """The same model with every packed bank decoded into dense fp32 parameters, run by the same expert loop as the packed
    banks, so the comparison sees the weights only, not a different summation order: where the C kernels build, the packed
    banks' picked experts run in moe.c's loop, which "sized" also takes for dense banks; elsewhere both take the grouped op."""
    dense = build(debug())
    for moe in dense.moe_layers():
        moe.backend = LocalExperts("sized" if kernels_available() else "fast")
    dense.load_state_dict({k: v for k, v in packed_model.state_dict().items() if "experts.w" not in k}, strict=False)
    for src, dst in zip(packed_model.moe_layers(), dense.moe_layers(), strict=True):
        full = src.experts.bank().materialize(torch.float32)
        experts = dst.experts
        assert isinstance(experts, DenseExperts)
        with torch.no_grad():
            experts.w1.copy_(full.w1_EID)
            experts.w3.copy_(full.w3_EID)
            experts.w2.copy_(full.w2_EDI)
    return dense


def test_packed_model_equals_materialised_dequantised_weights() -> None:
    model = build(debug())
    model.quantize_experts()
    assert all(isinstance(m.experts, PackedExperts) for m in model.moe_layers())
    assert not any(isinstance(p, torch.nn.Parameter) and p.dtype == torch.uint8 for p in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(model.forward_tokens(TOKENS), dequantised_copy(model).forward_tokens(TOKENS), atol=1e-5, rtol=1e-5)


def test_packed_bytes_are_4_25_bits_per_weight() -> None:
    model = build(debug())
    dense_bytes = sum(dense_bank_nbytes(cast(DenseExpertBank, m.experts.bank())) for m in model.moe_layers())  # fp32 here
    model.quantize_experts()
    packed_bytes = sum(cast(PackedMXFP4ExpertBank, m.experts.bank()).nbytes for m in model.moe_layers())
    assert packed_bytes / dense_bytes == pytest.approx(4.25 / 32)


def test_k3_layout_round_trip_and_quantize_cli(tmp_path: Path) -> None:
    model = build(debug())
    save_model(model, tmp_path / "dense")
    assert main(["quantize", str(tmp_path / "dense"), str(tmp_path / "mx"), "--dtype", "float32"]) == 0
    with safe_open(str(tmp_path / "mx" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.layers.1.block_sparse_moe.experts.5.w2.weight_packed").get_shape() == [32, 16]
        assert f.get_slice("model.layers.1.block_sparse_moe.experts.5.w2.weight_scale").get_shape() == [32, 1]
    assert not any(n.endswith("experts.5.w2.weight") for n in names)
    assert '"mxfp4-pack-quantized"' in (tmp_path / "mx" / "config.json").read_text()
    loaded = load_model(tmp_path / "mx")
    assert all(isinstance(m.experts, PackedExperts) for m in loaded.moe_layers())
    model.quantize_experts()
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward_tokens(TOKENS), model.forward_tokens(TOKENS), atol=0, rtol=0)


def test_gpt_oss_block_names_load_like_k3_names(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from openk3.model.weights import export_state_dict

    model = build(debug())
    model.quantize_experts()
    tensors = {}
    for name, t in export_state_dict(model).items():
        if name.endswith("weight_packed"):
            tensors[name.replace("weight_packed", "weight_blocks")] = t.reshape(t.shape[0], -1, 16)
        elif name.endswith("weight_scale"):
            tensors[name.replace("weight_scale", "weight_scales")] = t
        else:
            tensors[name] = t
    (tmp_path / "g").mkdir()
    save_config(model.config, tmp_path / "g" / "config.json")
    save_file(tensors, str(tmp_path / "g" / "model.safetensors"))
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path / "g").forward_tokens(TOKENS), model.forward_tokens(TOKENS), atol=0, rtol=0)


def test_dense_checkpoint_of_an_mxfp4_config_loads_dense(tmp_path: Path) -> None:
    model = build(debug())
    save_model(model, tmp_path / "d")
    assert all(isinstance(m.experts, DenseExperts) for m in load_model(tmp_path / "d").moe_layers())


def test_the_bank_is_kept_while_its_buffers_are_the_same_tensors() -> None:
    experts = PackedExperts(4, 64, 32)
    bank = cast(PackedMXFP4ExpertBank, experts.bank())
    decode = bank.decode
    assert experts.bank() is bank
    scales = cast(torch.Tensor, experts.w2_weight_scale)
    scales.fill_(127)  # in place: the kept bank holds the same tensor and sees the write
    assert torch.equal(cast(PackedMXFP4ExpertBank, experts.bank()).w2.scales, scales)
    codes = torch.ones(4, 32, 32, dtype=torch.uint8)
    experts.w1_weight_packed = codes  # a new tensor: a new bank over it
    rebuilt = cast(PackedMXFP4ExpertBank, experts.bank())
    assert rebuilt is not bank and rebuilt.w1.packed is codes
    assert experts.bank(decode=lambda p, s, d, t: p) is not rebuilt  # another decode form: a new bank
    assert experts.bank(decode) is not rebuilt and experts.bank(decode) is experts.bank(decode)
