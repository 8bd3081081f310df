"""ops/cpu/linear.c's panel form (PackedWeight.panels): the few-row products of the "c" backend against F.linear, the
same sums whatever the row count, and the panel copy kept in step with the weight like oneDNN's copy (test_linear.py)."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

from openk3.ops import linear as linear_mod
from openk3.ops.cpu.build import kernels_available
from openk3.ops.linear import KERNEL_ROWS, PANEL_ROWS, PackedWeight, linear_c, pack_panels

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C compiler: the kernel cannot be built here")


def _enabled() -> PackedWeight:
    packed = PackedWeight()
    packed.enable()
    return packed


def test_pack_panels_layout() -> None:
    """[N/16][K][16], the last panel zero-padded: panel p, row k holds outputs 16p .. 16p + 15 at input k."""
    w = torch.arange(37 * 5, dtype=torch.float32).view(37, 5)
    p = pack_panels(w).view(3, 5, 16)
    assert torch.equal(p[0], w[:16].t())
    assert torch.equal(p[2, :, :5], w[32:].t())
    assert not p[2, :, 5:].any()


@pytest.mark.parametrize("out_features,width", [(16, 64), (37, 13), (1092, 256), (256, 768)])
def test_panels_match_f_linear_at_every_row_count(out_features: int, width: int) -> None:
    g = torch.Generator().manual_seed(out_features)
    w = torch.nn.Parameter(torch.randn(out_features, width, generator=g))
    x = torch.randn(PANEL_ROWS, width, generator=g)
    packed = _enabled()
    with torch.no_grad():
        one_by_one = [linear_c(x[i : i + 1], w, packed) for i in range(PANEL_ROWS)]
        for rows in range(1, PANEL_ROWS + 1):
            y = linear_c(x[:rows], w, packed)
            torch.testing.assert_close(y, F.linear(x[:rows], w), rtol=1e-5, atol=1e-4)
            # each output is one in-order sum along k: the same bits whichever tile a row falls in
            assert torch.equal(y, torch.cat(one_by_one[:rows]))
    assert packed._panels is not None


def test_panels_only_for_an_enabled_copy_up_to_panel_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = linear_mod._panels_kernel()

    def spy(rows: int, *rest: object) -> None:
        calls.append(rows)
        real(rows, *rest)

    monkeypatch.setattr(linear_mod, "_panels_kernel", lambda: spy)
    w = torch.nn.Parameter(torch.randn(64, 128))
    with torch.no_grad():
        linear_c(torch.randn(4, 128), w)  # no PackedWeight: the stored layout's kernel
        linear_c(torch.randn(4, 128), w, PackedWeight())  # not enabled
        packed = _enabled()
        linear_c(torch.randn(PANEL_ROWS + 1, 128), w, packed)  # above the panel form: oneDNN
        linear_c(torch.randn(PANEL_ROWS, 128), w, packed)
        linear_c(torch.randn(KERNEL_ROWS, 128), w, packed)
        linear_c(torch.randn(2, 3, 128), w, packed)  # leading dims: 6 rows
        linear_c(torch.randn(KERNEL_ROWS + 1, 128), w)  # no panel copy: past the stored layout's kernel, the torch forms
    assert calls == [PANEL_ROWS, KERNEL_ROWS, 6]


def test_panel_copy_follows_writes_and_moves() -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.nn.Parameter(torch.randn(48, 64, generator=g))
    x = torch.randn(5, 64, generator=g)
    packed = _enabled()
    with torch.no_grad():
        torch.testing.assert_close(linear_c(x, w, packed), F.linear(x, w))
        first = packed._panels
        linear_c(x, w, packed)
        assert packed._panels is first  # made once
        w.mul_(-2.0)
        torch.testing.assert_close(linear_c(x, w, packed), F.linear(x, w))
        w.data = torch.randn(w.shape, generator=g)
        torch.testing.assert_close(linear_c(x, w, packed), F.linear(x, w))
        a, b = (torch.nn.Parameter(torch.randn(32, 64, generator=g)) for _ in range(2))
        block = torch.cat([a.detach(), b.detach()])
        a.data, b.data = block[:32], block[32:]  # a fused group's block (serve/fused.py)
        block_packed = _enabled()
        torch.testing.assert_close(linear_c(x, block, block_packed, [a, b]), F.linear(x, block))
        b.copy_(torch.randn(b.shape, generator=g))  # bumps b's counter, not the block's
        torch.testing.assert_close(linear_c(x, block, block_packed, [a, b]), F.linear(x, torch.cat([a, b])))


def test_inference_tensors_get_no_panels_and_copies_start_empty() -> None:
    with torch.inference_mode():
        w = torch.randn(32, 64)
        packed = _enabled()
        x = torch.randn(3, 64)
        torch.testing.assert_close(linear_c(x, w, packed), F.linear(x, w))
    assert packed._panels is None
    w2 = torch.nn.Parameter(torch.randn(32, 64))
    with torch.no_grad():
        linear_c(torch.randn(3, 64), w2, packed)
    assert packed._panels is not None
    clone = pickle.loads(pickle.dumps(packed))
    assert clone.enabled and clone._panels is None
