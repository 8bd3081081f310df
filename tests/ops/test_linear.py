"""ops.linear / ops.bmm_weight_t against F.linear / matmul on every path they choose between (fp32 rounding apart)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from openk3.ops import linear as linear_mod
from openk3.ops.linear import LARGE_WEIGHT, SMALL_ROWS, bmm_weight_t, linear


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [0, 1, 2, 5, 8, 9, 16, 64])
@pytest.mark.parametrize("out_features", [64, LARGE_WEIGHT // 256 + 3])  # small (F.linear) and large (oneDNN on CPU)
def test_linear_matches_f_linear(rows: int, out_features: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, 256, generator=g)
    x = torch.randn(rows, 256, generator=g)
    with torch.inference_mode():
        _close(linear(x, w), F.linear(x, w))
        _close(linear(x.view(1, rows, 256), w), F.linear(x, w).view(1, rows, out_features))  # leading dims kept


def test_linear_paths_by_weight_size_rows_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN from SMALL_ROWS + 1 rows on a large fp32 weight only; the weight-first mm up to SMALL_ROWS rows."""
    if linear_mod._onednn is None:
        pytest.skip("this torch build has no oneDNN linear")
    onednn: list[tuple[int, ...]] = []
    real = linear_mod._onednn

    def spy(x: torch.Tensor, w: torch.Tensor, *rest: object) -> torch.Tensor:
        onednn.append(tuple(x.shape))
        return real(x, w, *rest)

    monkeypatch.setattr(linear_mod, "_onednn", spy)
    big, small = torch.randn(LARGE_WEIGHT // 128, 128), torch.randn(16, 128)
    many, few = torch.randn(SMALL_ROWS + 1, 128), torch.randn(SMALL_ROWS, 128)
    with torch.inference_mode():
        linear(many, big)
        linear(few, big)  # weight-first, not oneDNN
        linear(many, small)
        linear(many.double(), big.double())  # fp32 only
    assert onednn == [tuple(many.shape)]


def test_linear_rows_of_a_block_and_strided_input() -> None:
    block = torch.randn(3 * 700, 256)
    w = block[700:1400]  # a fused projection's rows: a view, contiguous
    x = torch.randn(8, 512)[:, ::2]  # strided activations
    with torch.inference_mode():
        _close(linear(x, w), F.linear(x, w))


def test_linear_under_autograd_matches_f_linear_gradients() -> None:
    w = torch.randn(LARGE_WEIGHT // 256, 256, requires_grad=True)
    x = torch.randn(4, 256, requires_grad=True)
    linear(x, w).square().sum().backward()
    gx, gw = x.grad, w.grad
    x.grad = w.grad = None
    F.linear(x, w).square().sum().backward()
    _close(gx, x.grad)
    _close(gw, w.grad)


@pytest.mark.parametrize("rows", [0, 1, 2, 5, SMALL_ROWS, SMALL_ROWS + 1, 16])
def test_bmm_weight_t_matches_matmul(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(6, 96, 64, generator=g)
    x = torch.randn(6, rows, 64, generator=g)
    out = bmm_weight_t(x, w)
    _close(out, torch.matmul(x, w.transpose(1, 2)))
    assert out.is_contiguous()


def test_bmm_weight_t_gradients() -> None:
    w = torch.randn(4, 32, 16, requires_grad=True)
    x = torch.randn(4, 3, 16, requires_grad=True)
    bmm_weight_t(x, w).sum().backward()
    gx, gw = x.grad, w.grad
    x.grad = w.grad = None
    torch.matmul(x, w.transpose(1, 2)).sum().backward()
    _close(gx, x.grad)
    _close(gw, w.grad)
