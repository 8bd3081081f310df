"""The latent MoE block after its router in one C call (ops/moe/block_c.py, ops/cpu/moe.c openk3_moe_latent_block): equal to
the definition's torch ops up to fp32 rounding, and bit for bit to the separate C calls it replaces (panel products,
packed expert loop, RMSNorm, GLU), with and without the latent norm, for both activations; "auto" takes it on the "c"
backend and the definition elsewhere. With the router's top-k in the call ("moe_routed_latent_block"): bit for bit the
C router (sigmoid_topk_route_c) followed by the block, with and without a bias, renormalised or not."""

from __future__ import annotations

import functools

import pytest
import torch

from openk3.config import Activation
from openk3.ops.activation import glu
from openk3.ops.cpu.build import kernels_available
from openk3.ops.glu_c import glu_c
from openk3.ops.linear import pack_panels
from openk3.ops.moe.block_c import (
    LatentBlockWeights,
    moe_latent_block_c,
    moe_latent_block_reference,
    moe_routed_latent_block_c,
    moe_routed_latent_block_reference,
)
from openk3.ops.moe.packed_bank import PackedMXFP4ExpertBank
from openk3.ops.moe.packed_c import moe_experts_packed_c
from openk3.ops.moe.router import sigmoid_topk_route_c
from openk3.ops.norm import rms_norm_c
from openk3.ops.registry import CPU_INFERENCE, OpTarget, registry

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the C kernels do not build here")
D, L, I, S, E, K = 96, 64, 32, 48, 8, 2


def block(act: Activation, norm: bool, seed: int) -> LatentBlockWeights:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    bank = PackedMXFP4ExpertBank.from_dense(w(E, I, L), w(E, I, L), w(E, L, I))
    down, up, gate_up, shared_down = w(L, D), w(D, L), w(2 * S, D), w(D, S)
    return LatentBlockWeights(
        down, bank, functools.partial(glu, kind=act, beta=4.0, linear_beta=25.0), torch.rand(L, generator=g) + 0.5 if norm else None, 1e-6,
        up, gate_up, act, 4.0, 25.0, shared_down, tuple(pack_panels(t) for t in (down, up, gate_up, shared_down)),  # type: ignore[arg-type]
    )  # fmt: skip


def routing(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]), torch.rand(t, K, generator=g)


def separate_calls(x: torch.Tensor, idx: torch.Tensor, weight: torch.Tensor, w: LatentBlockWeights) -> torch.Tensor:
    """The calls of the unfused layer on the "c" backend, each from the same panel copies."""
    from openk3.ops.linear import _linear_panels_c

    down, up, gate_up, shared_down = w.panels  # type: ignore[misc]
    t = x.shape[0]
    z = moe_experts_packed_c(_linear_panels_c(x, down, L, t), idx, weight, w.bank, w.expert_act)
    if w.norm_L is not None:
        z = rms_norm_c(z, w.norm_L, w.eps)
    g, u = _linear_panels_c(x, gate_up, 2 * S, t).split([S, S], dim=-1)
    return _linear_panels_c(z, up, D, t) + _linear_panels_c(glu_c(g, u, w.shared_act, 4.0, 25.0), shared_down, D, t)


@pytest.mark.parametrize("act", [Activation.SILU, Activation.SITU])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("t", [1, 7, 16, 40])
def test_equals_the_separate_calls_bit_for_bit_and_the_definition(act: Activation, norm: bool, t: int) -> None:
    w = block(act, norm, seed=t)
    x = torch.randn(t, D, generator=torch.Generator().manual_seed(t + 1)) * 2
    idx, weight = routing(t, seed=t + 2)
    got = moe_latent_block_c(x, idx, weight, w)
    assert torch.equal(got, separate_calls(x, idx, weight, w))
    torch.testing.assert_close(got, moe_latent_block_reference(x, idx, weight, w), rtol=1e-4, atol=1e-4)


def test_refusals_and_the_auto_rule() -> None:
    w = block(Activation.SITU, True, seed=0)
    x = torch.randn(3, D)
    idx, weight = routing(3, seed=1)
    with pytest.raises(ValueError, match="expert ids span"):
        moe_latent_block_c(x, idx + E, weight, w)
    with pytest.raises(ValueError, match="no panel copies"):
        moe_latent_block_c(x, idx, weight, w._replace(panels=None))
    with pytest.raises(ValueError, match="widths that do not chain"):
        moe_latent_block_c(torch.randn(3, D + 1), idx, weight, w)
    assert registry().get("moe_latent_block", "auto", CPU_INFERENCE) is moe_latent_block_c
    assert registry().get("moe_latent_block", "auto", OpTarget(c_kernels=False)) is moe_latent_block_reference


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("t", [1, 16])
def test_routed_block_equals_the_c_router_then_the_block_bit_for_bit(bias: bool, renormalize: bool, t: int) -> None:
    w = block(Activation.SITU, True, seed=t + 5)
    g = torch.Generator().manual_seed(t + 6)
    x = torch.randn(t, D, generator=g)
    router, bias_E = torch.randn(E, D, generator=g) / D**0.5, torch.randn(E, generator=g) * 0.1 if bias else None
    routing = sigmoid_topk_route_c(x, router, bias_E, K, renormalize, 2.5)
    got = moe_routed_latent_block_c(x, router, bias_E, K, renormalize, 2.5, w)
    assert torch.equal(got, moe_latent_block_c(x, routing.topk_idx, routing.topk_weight, w))
    torch.testing.assert_close(got, moe_routed_latent_block_reference(x, router, bias_E, K, renormalize, 2.5, w), rtol=1e-4, atol=1e-4)


def test_routed_block_refusals_and_the_auto_rule() -> None:
    w = block(Activation.SITU, True, seed=0)
    x, router = torch.randn(3, D), torch.randn(E, D)
    with pytest.raises(ValueError, match="a router of 9 experts"):
        moe_routed_latent_block_c(x, torch.randn(E + 1, D), None, K, True, 1.0, w)
    with pytest.raises(ValueError, match="k=0"):
        moe_routed_latent_block_c(x, router, None, 0, True, 1.0, w)
    with pytest.raises(ValueError, match="no panel copies"):
        moe_routed_latent_block_c(x, router, None, K, True, 1.0, w._replace(panels=None))
    assert registry().get("moe_routed_latent_block", "auto", CPU_INFERENCE) is moe_routed_latent_block_c
    assert registry().get("moe_routed_latent_block", "auto", OpTarget(c_kernels=False)) is moe_routed_latent_block_reference
