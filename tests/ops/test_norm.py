"""RMSNorm: torch's fused kernel (the fast path) equals the spelled-out definition, in fp32 and bf16, with and without a weight."""

from __future__ import annotations

import pytest
import torch

from openk3.ops.cpu.build import kernels_available
from openk3.ops.norm import rms_norm, rms_norm_c, rms_norm_reference
from openk3.ops.registry import OpTarget, op

needs_kernels = pytest.mark.skipif(not kernels_available(), reason="no C compiler: the kernel cannot be built here")


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


@pytest.mark.parametrize("layout", ["contiguous", "row views", "transposed", "empty"])
@pytest.mark.parametrize("with_weight", [True, False])
@needs_kernels
def test_cpu_kernel_path_equals_definition(layout: str, with_weight: bool) -> None:
    """At inference on CPU in fp32 the C kernel of ops/cpu/norm.c (the "c" backend): every input layout gives the
    definition's values."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(6, 5, 200, generator=g) * 3
    x = {
        "contiguous": base[..., :96].contiguous(),
        "row views": base[..., 50:146],  # rows inside a wider tensor (a projection's column block)
        "transposed": base[..., :96].transpose(0, 1),
        "empty": base[:0, :, :96],
    }[layout]
    weight = torch.randn(96, generator=g) if with_weight else None
    with torch.inference_mode():
        got = rms_norm_c(x, weight, 1e-6)
    assert got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got, rms_norm_reference(x, weight, 1e-6), rtol=1e-6, atol=1e-6)


@needs_kernels
def test_the_kernel_is_chosen_for_inference_and_refuses_autograd() -> None:
    assert op("rms_norm", "auto") is rms_norm_c
    assert op("rms_norm", "auto", OpTarget(training=True)) is rms_norm  # the graph needs torch's op
    assert op("rms_norm", "auto", OpTarget(dtype=torch.bfloat16)) is rms_norm
    w = torch.ones(8, requires_grad=True)
    with pytest.raises(RuntimeError, match="rms_norm: .* with autograd on"):
        rms_norm_c(torch.randn(3, 8), w, 1e-6)
