"""The training KDA (chunked, autograd-friendly) against the per-token definition: outputs, final states and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from openk3.ops.kda.chunk_autograd import kda_chunk_autograd
from openk3.ops.kda.naive import kda_recurrent


def inputs(
    B: int, T: int, H: int = 2, K: int = 16, V: int = 8, seed: int = 0, lower_bound: float = -5.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v, g (log decay), beta, each requiring grad."""
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    v = torch.randn(B, T, H, V, generator=g)
    decay = lower_bound * torch.sigmoid(torch.randn(B, T, H, K, generator=g))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=g))
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), decay.requires_grad_(), beta.requires_grad_()


@pytest.mark.parametrize("T,chunk", [(70, 16), (32, 32), (5, 16)])
def test_values_states_and_gradients_match_the_recurrence(T, chunk):
    xs = inputs(2, T)
    s0 = torch.randn(2, 2, 16, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    o1, s1 = kda_chunk_autograd(*xs, initial_state=s0, chunk_size=chunk)
    w = torch.randn_like(o1)
    g1 = torch.autograd.grad((o1 * w).sum() + s1.square().sum(), [*xs, s0])
    o2, s2 = kda_recurrent(*xs, initial_state=s0)
    g2 = torch.autograd.grad((o2 * w).sum() + s2.square().sum(), [*xs, s0])
    torch.testing.assert_close(o1, o2, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s1, s2, atol=2e-5, rtol=1e-4)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4)


def test_packed_sequences_and_strong_decay():
    xs = inputs(1, 70, lower_bound=-60.0)  # far beyond what a factorised exp(G) exp(-G) form survives in fp32
    cu = torch.tensor([0, 30, 31, 70])
    o1, s1 = kda_chunk_autograd(*xs, cu_seqlens=cu, chunk_size=32)
    o2, s2 = kda_recurrent(*xs, cu_seqlens=cu)
    assert torch.isfinite(o1).all()
    torch.testing.assert_close(o1, o2, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s1, s2, atol=2e-5, rtol=1e-4)
