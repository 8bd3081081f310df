"""The C MXFP4 decode (ops/mxfp4_c.py) against mxfp4.dequantize bit for bit, and its use by a packed bank and the MoE layer."""

from __future__ import annotations

import pytest
import torch

from openk3.config import debug
from openk3.model import K3ForCausalLM, OpChoice
from openk3.model.moe import LatentMoE, LocalExperts, PackedExperts
from openk3.ops import mxfp4
from openk3.ops.cpu.build import kernels_available
from openk3.ops.moe import packed_bank as pb
from openk3.ops.mxfp4_c import dequantize_c
from openk3.ops.registry import OpTarget, op

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C compiler: the C kernels cannot be built here")


def test_every_byte_under_every_scale_decodes_to_the_same_bits() -> None:
    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # every byte ...
    scales = torch.arange(256, dtype=torch.uint8).unsqueeze(1).repeat(1, 16)  # ... under every scale (0: denormals, 255: NaN)
    want, got = mxfp4.dequantize(packed, scales, torch.float32), dequantize_c(packed, scales, torch.float32, mxfp4.decode_tables(torch.float32))
    assert got.shape == (256, 512) and got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_blocks_of_other_sizes_and_leading_dims() -> None:
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (3, 5, 64), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 140, (3, 5, 8), dtype=torch.uint8, generator=g)  # 16-element blocks
    assert torch.equal(dequantize_c(packed, scales), mxfp4.dequantize(packed, scales, torch.float32))
    assert torch.equal(dequantize_c(packed[:, 1:4], scales[:, 1:4]), mxfp4.dequantize(packed[:, 1:4], scales[:, 1:4], torch.float32))


def test_refuses_what_it_was_not_chosen_for() -> None:
    packed, scales = torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match="decodes to fp32 on CPU"):
        dequantize_c(packed, scales, torch.bfloat16)
    with pytest.raises(ValueError, match="leading dims"):
        dequantize_c(packed, torch.zeros(3, 1, dtype=torch.uint8))


def test_the_moe_layer_decodes_with_the_form_chosen_for_its_target() -> None:
    assert op("mxfp4_decode", "auto") is dequantize_c and op("mxfp4_decode", "auto", OpTarget(c_kernels=False)) is mxfp4.dequantize
    model = K3ForCausalLM(debug(), ops=OpChoice(packed_experts=True))
    model.init_weights(0)
    layers = [m for m in model.modules() if isinstance(m, LatentMoE)]
    assert layers and all(isinstance(m.experts, PackedExperts) and isinstance(m.backend, LocalExperts) for m in layers)
    for m in layers:
        for name, buf in m.experts.named_buffers():
            buf.copy_(
                torch.randint(0, 256, buf.shape, dtype=torch.uint8) if name.endswith("_packed") else torch.randint(120, 126, buf.shape, dtype=torch.uint8)
            )
    ids = torch.randint(0, 256, (1, 9))
    backends = [m.backend for m in layers if isinstance(m.backend, LocalExperts)]
    with torch.no_grad():
        logits_c = model.forward_tokens(ids)
        assert all(b.decode is dequantize_c for b in backends)
        for b in backends:
            b.decode = mxfp4.dequantize
        logits_torch = model.forward_tokens(ids)
    assert torch.equal(logits_c, logits_torch)  # the same decoded weights, the same products


def test_a_bank_decodes_with_its_decode_form() -> None:
    g = torch.Generator().manual_seed(1)
    w1, w3, w2 = (torch.randn(*s, generator=g) * 0.05 for s in ((4, 64, 96), (4, 64, 96), (4, 96, 64)))
    seen = []

    def counting(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, tables: mxfp4.DecodeTables) -> torch.Tensor:
        seen.append(tuple(packed.shape))
        return dequantize_c(packed, scales, dtype, tables)

    plain = pb.PackedMXFP4ExpertBank.from_dense(w1, w3, w2)
    bank = pb.PackedMXFP4ExpertBank(plain.w1, plain.w3, plain.w2, decode=counting)
    assert all(torch.equal(a, b) for a, b in zip(bank.expert(2, torch.float32), plain.expert(2, torch.float32), strict=True))
    assert seen == [(64, 48), (64, 48), (96, 32)]


def test_a_packed_bank_goes_through_the_c_loop_with_the_picked_experts_decoded_once() -> None:
    """moe_experts_sized on the "c" backend: the experts a multi-token step picked are decoded in one call per projection
    into a dense bank of their own (ids remapped), and the result equals the per-expert grouped path's."""
    import functools

    from openk3.config import Activation
    from openk3.ops.activation import glu
    from openk3.ops.linear import linear_c
    from openk3.ops.moe import moe_experts_grouped, moe_experts_sized
    from openk3.ops.moe.cpu_pairs import moe_experts_batched_c

    g = torch.Generator().manual_seed(2)
    w1, w3, w2 = (torch.randn(*s, generator=g) * 0.05 for s in ((8, 64, 96), (8, 64, 96), (8, 96, 64)))
    calls = []

    def counting(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, tables: mxfp4.DecodeTables) -> torch.Tensor:
        calls.append(packed.shape[0])
        return dequantize_c(packed, scales, dtype, tables)

    plain = pb.PackedMXFP4ExpertBank.from_dense(w1, w3, w2)
    bank = pb.PackedMXFP4ExpertBank(plain.w1, plain.w3, plain.w2, decode=counting)
    x = torch.randn(5, 96, generator=g)
    idx = torch.tensor([[1, 6], [6, 3], [1, 3], [3, 6], [1, 6]])  # experts 1, 3, 6 picked
    weight = torch.rand(5, 2, generator=g)
    act = functools.partial(glu, kind=Activation.SITU)  # as the model builds expert_act: an activation moe.c knows
    got = moe_experts_sized(x, idx, weight, bank, act, linear=linear_c, batched_c=moe_experts_batched_c)
    assert calls == [3, 3, 3]  # one decode per projection, of the three picked experts
    want = moe_experts_grouped(x, idx, weight, plain, act, linear=linear_c)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
