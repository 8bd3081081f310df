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


@pytest.mark.parametrize("layout", ["contiguous", "row views", "transposed", "empty"])
@pytest.mark.parametrize("with_weight", [True, False])
def test_cpu_kernel_path_equals_definition(layout: str, with_weight: bool) -> None:
    """At inference on CPU in fp32 rms_norm runs the C kernel of ops/cpu/norm.c (when it could be built): every input layout
    it takes or hands back to torch gives the definition's values."""
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
        got = rms_norm(x, weight, 1e-6)
    assert got.shape == x.shape and got.is_contiguous()
    torch.testing.assert_close(got, rms_norm_reference(x, weight, 1e-6), rtol=1e-6, atol=1e-6)


def test_cpu_kernel_path_is_taken_at_inference_and_not_under_autograd(monkeypatch: pytest.MonkeyPatch) -> None:
    from openk3.ops import norm

    if norm._rms_norm_cpu(torch.ones(1, 4), None, 1e-6) is None:
        pytest.skip("no C compiler: the kernel cannot be built here")
    calls: list[int] = []
    real = norm._kernel()

    def counting(rows: int, *rest: object) -> None:
        calls.append(rows)
        real(rows, *rest)

    monkeypatch.setattr(norm, "_kernel", lambda: counting)
    w = torch.ones(8, requires_grad=True)
    with torch.inference_mode():
        rms_norm(torch.randn(3, 8), w, 1e-6)
    rms_norm(torch.randn(3, 8), w, 1e-6).sum().backward()  # the graph needs torch's op
    assert calls == [3] and w.grad is not None
