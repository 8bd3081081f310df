"""ops.linear / ops.bmm_weight_t against F.linear / matmul on every path they choose between (fp32 rounding apart): the
registry's CPU entries of "linear", with the C rows kernel ("c" backend) and without it ("cpu")."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from openk3.ops import linear as linear_mod
from openk3.ops.cpu.build import kernels_available
from openk3.ops.linear import KERNEL_ROWS, LARGE_WEIGHT, PANEL_ROWS, SMALL_ROWS, LinearFn, PackedWeight, bmm_weight_t, linear_c, linear_cpu, linear_torch
from openk3.ops.registry import OpTarget, op

PARAMS = [pytest.param("C kernel", marks=pytest.mark.skipif(not kernels_available(), reason="no C compiler: the kernel cannot be built here")), "torch forms"]


@pytest.fixture(params=PARAMS)
def rows_kernel(request: pytest.FixtureRequest) -> str:
    """On CPU up to KERNEL_ROWS rows run ops/cpu/linear.c (the "c" backend); every test runs with it and with the torch
    forms that take those rows without it (the "cpu" backend)."""
    return str(request.param)


@pytest.fixture
def linear(rows_kernel: str) -> LinearFn:
    return linear_c if rows_kernel == "C kernel" else linear_cpu


def test_the_registry_offers_them_by_target() -> None:
    assert op("linear", "auto", OpTarget(c_kernels=False)) is linear_cpu
    assert op("linear", "auto", OpTarget(training=True)) is linear_torch  # autograd: F.linear
    assert op("linear", "auto", OpTarget(dtype=torch.bfloat16)) is linear_torch
    assert op("linear", "auto", OpTarget("cuda")) is linear_torch
    if kernels_available():
        assert op("linear", "auto") is linear_c


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 8, 9, 16, 17, 64])
@pytest.mark.parametrize("out_features,width", [(64, 256), (LARGE_WEIGHT // 256 + 3, 256), (13, 37)])  # small, large, odd sizes
def test_linear_matches_f_linear(rows: int, out_features: int, width: int, rows_kernel: str, linear: LinearFn) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, width, generator=g)
    x = torch.randn(rows, width, generator=g)
    with torch.inference_mode():
        _close(linear(x, w), F.linear(x, w))
        _close(linear(x.view(1, rows, width), w), F.linear(x, w).view(1, rows, out_features))  # leading dims kept


def test_linear_paths_by_weight_size_and_rows(monkeypatch: pytest.MonkeyPatch, rows_kernel: str, linear: LinearFn) -> None:
    """The C kernel up to KERNEL_ROWS rows, any fp32 weight; without it the weight-first mm up to SMALL_ROWS rows on a large
    weight. oneDNN above those on a large fp32 weight only."""
    if linear_mod._onednn is None:
        pytest.skip("this torch build has no oneDNN linear")
    onednn: list[tuple[int, ...]] = []
    kernel: list[int] = []
    real = linear_mod._onednn

    def spy(x: torch.Tensor, w: torch.Tensor, *rest: object) -> torch.Tensor:
        onednn.append(tuple(x.shape))
        return real(x, w, *rest)

    monkeypatch.setattr(linear_mod, "_onednn", spy)
    if rows_kernel == "C kernel":
        real_kernel = linear_mod._rows_kernel()

        def kernel_spy(rows: int, *rest: object) -> None:
            kernel.append(rows)
            real_kernel(rows, *rest)

        monkeypatch.setattr(linear_mod, "_rows_kernel", lambda: kernel_spy)
    big, small = torch.randn(LARGE_WEIGHT // 128, 128), torch.randn(16, 128)
    above = KERNEL_ROWS if rows_kernel == "C kernel" else SMALL_ROWS
    many, few = torch.randn(above + 1, 128), torch.randn(above, 128)
    with torch.inference_mode():
        linear(many, big)
        linear(few, big)  # the kernel or weight-first, not oneDNN
        linear(many, small)
        linear(few, small)
    assert onednn == [tuple(many.shape)]
    assert kernel == ([above, above] if rows_kernel == "C kernel" else [])


def _needs_packing() -> None:
    if linear_mod._reorder is None:
        pytest.skip("this torch build has no oneDNN weight reorder")


def test_packed_weight_is_used_above_the_few_row_forms_and_matches(monkeypatch: pytest.MonkeyPatch, rows_kernel: str, linear: LinearFn) -> None:
    _needs_packing()
    seen: list[bool] = []
    real = linear_mod._onednn
    assert real is not None  # _reorder, which _needs_packing checked, exists only beside _onednn

    def spy(x: torch.Tensor, w: torch.Tensor, *rest: object) -> torch.Tensor:
        seen.append(w.is_mkldnn)  # the blocked copy is an opaque oneDNN tensor
        return real(x, w, *rest)

    monkeypatch.setattr(linear_mod, "_onednn", spy)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(LARGE_WEIGHT // 256 + 3, 256, generator=g)
    packed = PackedWeight()
    with torch.inference_mode():
        for rows in (PANEL_ROWS + 1, 64, 2048):  # above the panel form too (test_linear_panels.py)
            x = torch.randn(rows, 256, generator=g)
            _close(linear(x, w, packed), F.linear(x, w))  # not enabled: the plain weight
            packed.enabled = True
            _close(linear(x, w, packed), F.linear(x, w))
            _close(linear(x.view(2, rows // 2, 256) if rows % 2 == 0 else x, w, packed).reshape(rows, -1), F.linear(x, w))
            packed.enabled = False
        few = torch.randn(SMALL_ROWS, 256, generator=g)
        packed.enabled = True
        packed.reset()
        _close(linear(few, w, packed), F.linear(few, w))  # the kernel (or weight-first): no copy is made for it
    assert packed._packed is None
    assert seen == [False, True, True, False, True, True, False, True, True]


def test_packed_weight_follows_writes_and_moves(rows_kernel: str, linear: LinearFn) -> None:
    """Rebuilt after an in-place write (version counter) and a new tensor (address); for a fused block, after a write to
    one of its parameters, whose counter the block's own does not share. A write through .data is seen after reset()."""
    _needs_packing()
    g = torch.Generator().manual_seed(1)
    w = torch.nn.Parameter(torch.randn(LARGE_WEIGHT // 256, 256, generator=g))
    x = torch.randn(PANEL_ROWS + 1, 256, generator=g)
    packed = PackedWeight()
    packed.enabled = True
    with torch.no_grad():
        _close(linear(x, w, packed), F.linear(x, w))
        first = packed._packed
        linear(x, w, packed)
        assert packed._packed is first  # made once
        w.mul_(-2.0)
        _close(linear(x, w, packed), F.linear(x, w))
        w.data = torch.randn(w.shape, generator=g)
        _close(linear(x, w, packed), F.linear(x, w))
        w.data.mul_(3.0)  # no counter moves: the documented gap
        stale = linear(x, w, packed)
        assert not torch.allclose(stale, F.linear(x, w))
        packed.reset()
        _close(linear(x, w, packed), F.linear(x, w))

        a, b = (torch.nn.Parameter(torch.randn(LARGE_WEIGHT // 256, 256, generator=g)) for _ in range(2))
        block = torch.cat([a.detach(), b.detach()])
        a.data, b.data = block[: a.shape[0]], block[a.shape[0] :]  # how serve/fused.py ties a group
        block_packed = PackedWeight()
        block_packed.enabled = True
        _close(linear(x, block, block_packed, [a, b]), F.linear(x, block))
        b.copy_(torch.randn(b.shape, generator=g))  # lands in the block; bumps b's counter, not the block's
        assert block._version == 0
        _close(linear(x, block, block_packed, [a, b]), F.linear(x, torch.cat([a, b])))


def test_inference_tensors_are_not_packed(rows_kernel: str, linear: LinearFn) -> None:
    """A weight made under inference mode has no version counter, so a copy of it could not be checked: the plain one is used."""
    _needs_packing()
    with torch.inference_mode():
        w = torch.randn(LARGE_WEIGHT // 256, 256)
        x = torch.randn(PANEL_ROWS + 1, 256)
        packed = PackedWeight()
        packed.enabled = True
        _close(linear(x, w, packed), F.linear(x, w))
    assert packed._packed is None


def test_packed_weight_copies_start_empty(rows_kernel: str, linear: LinearFn) -> None:
    _needs_packing()
    w = torch.randn(LARGE_WEIGHT // 256, 256)
    packed = PackedWeight()
    packed.enabled = True
    with torch.inference_mode():
        linear(torch.randn(PANEL_ROWS + 1, 256), w, packed)
    assert packed._packed is not None
    for clone in (copy.deepcopy(packed), pickle.loads(pickle.dumps(packed))):
        assert clone.enabled and clone._packed is None


def test_linear_rows_of_a_block_and_strided_input(rows_kernel: str, linear: LinearFn) -> None:
    block = torch.randn(3 * 700, 256)
    w = block[700:1400]  # a fused projection's rows: a view, contiguous
    x = torch.randn(8, 512)[:, ::2]  # strided activations
    with torch.inference_mode():
        _close(linear(x, w), F.linear(x, w))


def test_the_cpu_forms_refuse_what_they_were_not_chosen_for(linear: LinearFn) -> None:
    """Chosen once for CPU fp32 inference, they never quietly drop a gradient or take another dtype: the error says to
    select again (training gets F.linear, test_the_registry_offers_them_by_target)."""
    w = torch.randn(LARGE_WEIGHT // 256, 256, requires_grad=True)
    with pytest.raises(RuntimeError, match="chosen for CPU fp32 inference, but got torch.float32 on cpu with autograd on.*select_ops"):
        linear(torch.randn(4, 256), w)
    with torch.no_grad(), pytest.raises(RuntimeError, match="but got torch.float64 on cpu. Choose again"):
        linear(torch.randn(4, 256).double(), w.double())


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
    got = torch.autograd.grad(bmm_weight_t(x, w).sum(), (x, w))
    want = torch.autograd.grad(torch.matmul(x, w.transpose(1, 2)).sum(), (x, w))
    for a, b in zip(got, want, strict=True):
        _close(a, b)
