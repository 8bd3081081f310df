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

Weights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # w1, w3, w2 (or x, idx, weight for a layer's inputs)


def master(seed: int = 0) -> Weights:
    g = torch.Generator().manual_seed(seed)
    w1, w3, w2 = (torch.randn(*s, generator=g).mul(0.1).requires_grad_() for s in ((E, I, D), (E, I, D), (E, D, I)))
    return w1, w3, w2


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
    assert w.grad is not None and w_id.grad is not None
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


def _fit(qat: bool, steps: int = 30) -> tuple[Weights, torch.Tensor, Weights]:
    """Fit a student expert layer to a teacher's outputs, with or without fake quantisation in the forward."""
    g = torch.Generator().manual_seed(0)
    teacher = [torch.randn(*s, generator=g) * 0.2 for s in ((E, I, D), (E, I, D), (E, D, I))]
    x = torch.randn(64, D, generator=g)
    idx = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(64)])
    weight = torch.rand(64, 2, generator=g)
    target = moe_experts_grouped(x, idx, weight, DenseExpertBank(*teacher), situ_glu)
    w1, w3, w2 = (torch.nn.Parameter(torch.randn(*s, generator=g) * 0.2) for s in ((E, I, D), (E, I, D), (E, D, I)))
    student = (w1, w3, w2)
    opt = torch.optim.Adam(student, lr=1e-2)
    for _ in range(steps):
        bank = FakeQuantExpertBank(*student) if qat else DenseExpertBank(*student)
        loss = (moe_experts_grouped(x, idx, weight, bank, situ_glu) - target).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return student, target, (x, idx, weight)


def test_qat_beats_post_training_quantisation_and_exports_exactly() -> None:
    def loss(bank: ExpertBank, target: torch.Tensor, inputs: Weights) -> float:
        with torch.no_grad():
            return float((moe_experts_grouped(*inputs, bank, situ_glu) - target).square().mean())

    plain, target, inputs = _fit(qat=False)
    qat, _, _ = _fit(qat=True)
    ptq_loss = loss(FakeQuantExpertBank(*plain), target, inputs)  # the plain run's weights, quantised after training
    qat_loss = loss(FakeQuantExpertBank(*qat), target, inputs)
    assert qat_loss < 0.8 * ptq_loss
    # the exported packed bank serves exactly the fake-quantised forward the run optimised
    assert loss(FakeQuantExpertBank(*qat).export(), target, inputs) == qat_loss
