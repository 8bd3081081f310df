"""Packed MXFP4 expert bank: per-expert decode, resident bytes, checkpoint names, and MoE outputs vs the decoded weights."""

from __future__ import annotations

import pytest
import torch

from openk3.ops import mxfp4
from openk3.ops.activation import situ_glu
from openk3.ops.moe import packed_bank as pb
from openk3.ops.moe.bank import DenseExpertBank, ExpertBank
from openk3.ops.moe.grouped import moe_experts_grouped
from openk3.ops.moe.naive import moe_experts_naive

E, I, D = 6, 64, 96


def dense_experts(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w1, w3, w2 = (torch.randn(*shape, generator=g).mul(0.05).to(dtype) for shape in ((E, I, D), (E, I, D), (E, D, I)))
    return w1, w3, w2


def test_expert_is_the_dequantised_expert() -> None:
    w1, w3, w2 = dense_experts()
    bank = pb.PackedMXFP4ExpertBank.from_dense(w1, w3, w2)
    assert isinstance(bank, ExpertBank) and (bank.num_experts, bank.intermediate_size, bank.width) == (E, I, D)
    for name, w in zip(pb.PROJECTIONS, (w1, w3, w2), strict=True):
        whole = mxfp4.quantize(w)  # rows quantise independently, so the whole stack equals expert-by-expert
        assert torch.equal(getattr(bank, name).packed, whole.packed) and torch.equal(getattr(bank, name).scales, whole.scales)
    for dtype in (torch.float32, torch.bfloat16):
        for e in range(E):
            got = bank.expert(e, dtype)
            for t, packed in zip(got, (bank.w1, bank.w3, bank.w2), strict=True):
                assert t.dtype == dtype and torch.equal(t, mxfp4.dequantize_naive(packed.packed[e], packed.scales[e], dtype))


def test_expert_decodes_only_that_expert() -> None:
    plain = pb.PackedMXFP4ExpertBank.from_dense(*dense_experts())
    shapes = []

    def recording(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, tables: mxfp4.DecodeTables) -> torch.Tensor:
        shapes.append(tuple(packed.shape))
        return mxfp4.dequantize(packed, scales, dtype, tables)

    bank = pb.PackedMXFP4ExpertBank(plain.w1, plain.w3, plain.w2, decode=recording)  # the bank's decode seam
    bank.expert(3, torch.bfloat16)
    assert shapes == [(I, D // 2), (I, D // 2), (D, I // 2)]


def test_resident_bytes_are_4_25_bits_per_weight() -> None:
    w1, w3, w2 = dense_experts(dtype=torch.bfloat16)
    bank = pb.PackedMXFP4ExpertBank.from_dense(w1, w3, w2)
    dense = pb.dense_bank_nbytes(DenseExpertBank(w1, w3, w2))
    assert dense == 3 * E * I * D * 2 == bank.dense_nbytes(torch.bfloat16)
    assert bank.nbytes * 64 == dense * 17  # exactly 4.25 / 16
    assert bank.nbytes * 8 == 3 * E * I * D * 4.25


def test_checkpoint_names_round_trip() -> None:
    bank = pb.PackedMXFP4ExpertBank.from_dense(*dense_experts())
    prefix = "model.layers.1.block_sparse_moe."
    entries = bank.state_dict_entries(prefix)
    assert len(entries) == 6 * E
    assert entries[prefix + "experts.2.w2.weight_packed"].shape == (D, I // 2)
    assert entries[prefix + "experts.2.w1.weight_scale"].shape == (I, D // 32)
    # scales as safetensors' F8_E8M0 and codes as int8 read back as the same bytes
    stored = {k: v.view(torch.float8_e8m0fnu) if k.endswith("weight_scale") else v.view(torch.int8) for k, v in entries.items()}
    again = pb.PackedMXFP4ExpertBank.from_checkpoint(stored, E, prefix)
    for name in pb.PROJECTIONS:
        assert torch.equal(getattr(again, name).packed, getattr(bank, name).packed)
        assert torch.equal(getattr(again, name).scales, getattr(bank, name).scales)
    missing = dict(entries)
    del missing[prefix + "experts.4.w3.weight_scale"]
    with pytest.raises(KeyError, match=r"experts\.4\.w3\.weight_scale"):
        pb.PackedMXFP4ExpertBank.from_checkpoint(missing, E, prefix)
    bad = dict(entries)
    bad[prefix + "experts.5.w1.weight_packed"] = torch.zeros(I, D // 4, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"experts\.5\.w1\.weight_packed: shape \(64, 24\), expected \(64, 48\)"):
        pb.PackedMXFP4ExpertBank.from_checkpoint(bad, E, prefix)


def test_inconsistent_shapes_are_named() -> None:
    bank = pb.PackedMXFP4ExpertBank.from_dense(*dense_experts())
    with pytest.raises(ValueError, match="w2 packed"):
        pb.PackedMXFP4ExpertBank(bank.w1, bank.w3, mxfp4.MXFP4Tensor(bank.w2.packed[:, :32], bank.w2.scales[:, :32]))
    with pytest.raises(ValueError, match="multiple of 32"):
        pb.PackedMXFP4ExpertBank.from_dense(torch.zeros(2, 32, 48), torch.zeros(2, 32, 48), torch.zeros(2, 48, 32))


@pytest.mark.parametrize("op", [moe_experts_naive, moe_experts_grouped])
def test_moe_with_packed_bank_equals_materialised_weights(op) -> None:
    bank = pb.PackedMXFP4ExpertBank.from_dense(*dense_experts(dtype=torch.float32))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, D, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(10)])
    w = torch.rand(10, 2, generator=g)
    packed_out = op(x, idx, w, bank, situ_glu)
    dense_out = op(x, idx, w, bank.materialize(torch.float32), situ_glu)
    assert torch.equal(packed_out, dense_out)


def test_gpt_oss_experts_match_transformers_decode() -> None:
    bank = pb.PackedMXFP4ExpertBank.from_dense(*dense_experts())
    # gpt-oss fuses gate and up with interleaved rows: [E, 2I, D] with gate rows even, up rows odd
    fused = mxfp4.MXFP4Tensor(
        torch.stack((bank.w1.packed, bank.w3.packed), dim=2).reshape(E, 2 * I, D // 2),
        torch.stack((bank.w1.scales, bank.w3.scales), dim=2).reshape(E, 2 * I, D // 32),
    )
    gate_up_blocks, gate_up_scales = mxfp4.to_gpt_oss(fused)
    down_blocks, down_scales = mxfp4.to_gpt_oss(bank.w2)
    again = pb.PackedMXFP4ExpertBank.from_gpt_oss(gate_up_blocks, gate_up_scales, down_blocks, down_scales)
    for name in pb.PROJECTIONS:
        assert torch.equal(getattr(again, name).packed, getattr(bank, name).packed)
        assert torch.equal(getattr(again, name).scales, getattr(bank, name).scales)
    hf = pytest.importorskip("transformers.integrations.mxfp4", reason="transformers (test-only oracle) is not installed")
    gate_up = hf.convert_moe_packed_tensors(gate_up_blocks, gate_up_scales, dtype=torch.float32)  # [E, D, 2I] as gpt-oss uses it
    down = hf.convert_moe_packed_tensors(down_blocks, down_scales, dtype=torch.float32)  # [E, I, D]
    for e in range(E):
        w = again.expert(e, torch.float32)
        assert torch.equal(w.w1, gate_up[e, :, 0::2].T) and torch.equal(w.w3, gate_up[e, :, 1::2].T)
        assert torch.equal(w.w2, down[e].T)
