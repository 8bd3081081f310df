"""MXFP4 QAT: straight-through gradients, the fake-quantised forward, and export to a packed bank."""

from __future__ import annotations

import pytest
import torch

from openk3.ops import mxfp4
from openk3.ops.activation import situ_glu
from openk3.ops.moe.bank import DenseExpertBank, ExpertBank
from openk3.ops.moe.grouped import moe_experts_grouped
from openk3.train.qat import FakeQuantExpertBank, fake_quantize_mxfp4

E, I, D = 4, 64, 32


def master(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).mul(0.1).requires_grad_() for s in ((E, I, D), (E, I, D), (E, D, I))]


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_forward_is_dequant_of_quant(mode: str) -> None:
    w = torch.randn(8, 96) * 3
    assert torch.equal(fake_quantize_mxfp4(w, mode), mxfp4.dequantize(*mxfp4.quantize(w, scale_mode=mode), torch.float32))
    assert not torch.equal(fake_quantize_mxfp4(w, mode), w)  # the rounding is really applied


def test_straight_through_gradient_equals_the_identitys() -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(16, 64, generator=g).requires_grad_()
    x = torch.randn(5, 64, generator=g)
    upstream = torch.randn(5, 16, generator=g)
    (x @ fake_quantize_mxfp4(w).T).backward(upstream)
    w_id = w.detach().clone().requires_grad_()
    (x @ w_id.T).backward(upstream)  # the same graph with the identity in place of the rounding
    assert torch.equal(w.grad, w_id.grad)


def test_bank_forward_equals_fake_quantised_experts_and_export() -> None:
    w1, w3, w2 = master()
    bank = FakeQuantExpertBank(w1, w3, w2)
    assert isinstance(bank, ExpertBank)
    exported = bank.export()
    for e in range(E):
        for dtype in (torch.float32, torch.bfloat16):
            got, served = bank.expert(e, dtype), exported.expert(e, dtype)
            for t, s, w in zip(got, served, (w1, w3, w2), strict=True):
                assert torch.equal(t, mxfp4.dequantize(*mxfp4.quantize(w[e].detach()), dtype)) and torch.equal(t, s)


def test_bank_is_differentiable_to_master_weights() -> None:
    w1, w3, w2 = master(1)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, D, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(12)])
    weight = torch.rand(12, 2, generator=g)
    moe_experts_grouped(x, idx, weight, FakeQuantExpertBank(w1, w3, w2), situ_glu).square().sum().backward()
    # straight-through: the same loss with the fake-quantised values as plain leaves gives the same gradients
    fq = [fake_quantize_mxfp4(w.detach()).requires_grad_() for w in (w1, w3, w2)]
    moe_experts_grouped(x, idx, weight, DenseExpertBank(*fq), situ_glu).square().sum().backward()
    for w, f in zip((w1, w3, w2), fq, strict=True):
        assert w.grad is not None and w.grad.abs().sum() > 0
        torch.testing.assert_close(w.grad, f.grad, rtol=0, atol=0)


def test_unknown_scale_mode_is_named() -> None:
    with pytest.raises(ValueError, match="scale_mode 'stochastic'"):
        FakeQuantExpertBank(*master(), scale_mode="stochastic")
