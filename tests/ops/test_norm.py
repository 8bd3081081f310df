"""RMSNorm: torch's fused kernel (the fast path) equals the spelled-out definition, in fp32 and bf16, with and without a weight."""

from __future__ import annotations

import pytest
import torch

from openk3.ops.norm import rms_norm, rms_norm_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_weight", [True, False])
def test_fused_rms_norm_equals_definition(dtype: torch.dtype, with_weight: bool) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 3, 96, generator=g) * 5).to(dtype)
    weight = torch.randn(96, generator=g) if with_weight else None
    got, want = rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_rms_norm_of_zeros_is_zero_not_nan() -> None:
    assert torch.equal(rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-6), torch.zeros(2, 8))
