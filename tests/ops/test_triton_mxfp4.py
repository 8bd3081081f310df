"""The Triton MXFP4 expert kernels (ops/triton/), under TRITON_INTERPRET=1 without CUDA: the in-register decode bit for
bit against ops/mxfp4.py, the grouped GEMM's MoE output to tolerance against the grouped torch op on the same bank."""

from __future__ import annotations

import pytest
import torch

from openk3.ops import mxfp4
from openk3.ops.activation import situ_glu
from openk3.ops.moe import packed_bank as pb
from openk3.ops.moe.grouped import moe_experts_grouped
from openk3.ops.registry import OpTarget, op, registry
from openk3.ops.triton import triton_available

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton is not installed (the gpu extra)")]

E, I, D = 5, 64, 96  # D = 96: the K loop's last tile (64 wide) is half masked


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_is_bit_for_bit(dtype: torch.dtype) -> None:
    """Every byte (both nibbles) under every E8M0 scale, subnormal 2^-127 and NaN included; NaN payloads aside."""
    from openk3.ops.triton.mxfp4_decode import dequantize_triton

    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 1).to(device())  # [256, 256] bytes: 512 values per row
    scales = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 16).to(device())
    got, want = dequantize_triton(packed, scales, dtype).cpu(), mxfp4.dequantize(packed, scales, dtype).cpu()
    assert torch.equal(got.isnan(), want.isnan()) and bool(want.isnan().any())
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    finite = ~want.isnan()
    assert torch.equal(got.view(bits)[finite], want.view(bits)[finite])


def bank_and_routing(tokens: int, k: int, seed: int = 0) -> tuple[pb.PackedMXFP4ExpertBank, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w1, w3, w2 = (torch.randn(*shape, generator=g).mul(0.05) for shape in ((E, I, D), (E, I, D), (E, D, I)))
    bank = pb.PackedMXFP4ExpertBank.from_dense(w1, w3, w2)
    x = torch.randn(tokens, D, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])
    if tokens > 1:
        idx[0] = idx[1]  # two tokens with the same experts
    weight = torch.rand(tokens, k, generator=g)
    return bank, x, idx, weight


def to_device(bank: pb.PackedMXFP4ExpertBank) -> pb.PackedMXFP4ExpertBank:
    return pb.PackedMXFP4ExpertBank(*(mxfp4.MXFP4Tensor(t.packed.to(device()), t.scales.to(device())) for t in (bank.w1, bank.w3, bank.w2)))


@pytest.mark.parametrize("tokens,k,dtype,tol", [(1, 2, torch.float32, 1e-5), (19, 2, torch.float32, 1e-5), (7, 4, torch.bfloat16, 2e-2)])
def test_grouped_gemm_equals_grouped_op(tokens: int, k: int, dtype: torch.dtype, tol: float) -> None:
    """19 tokens x 2 slots over 5 experts: experts with more than one 16-row tile; one token: most experts idle."""
    from openk3.ops.triton.moe_mxfp4 import moe_experts_mxfp4

    bank, x, idx, weight = bank_and_routing(tokens, k)
    want = moe_experts_grouped(x.to(dtype), idx, weight, bank, situ_glu)
    got = moe_experts_mxfp4(x.to(dtype).to(device()), idx.to(device()), weight.to(device()), to_device(bank), situ_glu).cpu()
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=tol * float(want.abs().max()), rtol=tol)


def test_refuses_a_dense_bank_and_host_tensors_outside_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    from openk3.ops.triton.moe_mxfp4 import moe_experts_mxfp4

    bank, x, idx, weight = bank_and_routing(3, 2)
    with pytest.raises(TypeError, match="PackedMXFP4ExpertBank"):
        moe_experts_mxfp4(x, idx, weight, bank.materialize(torch.float32), situ_glu)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="CUDA"):
        moe_experts_mxfp4(x, idx, weight, bank, situ_glu)


def test_registered_for_cuda_by_name_only() -> None:
    assert "triton" in registry().names("moe_experts")
    assert registry().entry("moe_experts", "triton", OpTarget("cuda"))[1].backend == "cuda"
    assert registry().entry("moe_experts", "auto", OpTarget("cuda"))[0] == "sized"  # until measured on hardware (docs/gpu.md)
    with pytest.raises(ValueError, match="not available"):
        op("moe_experts", "triton", OpTarget("cpu"))
