"""The rows' argmax in C (ops/argmax_c.py, ops/cpu/argmax.c) gives torch.argmax's indices: random rows, ties (the first
index), NaNs (the first NaN), all -inf, strided rows, no rows; it refuses what it does not take; "auto" picks it on the "c"
backend and torch's elsewhere."""

from __future__ import annotations

import pytest
import torch

from openk3.ops.argmax_c import argmax_rows, argmax_rows_c
from openk3.ops.cpu.build import kernels_available
from openk3.ops.registry import CPU_INFERENCE, OpTarget, op

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the C kernels do not build here")


def test_equals_torch_argmax() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4096, generator=g)
    x[3] = torch.randint(0, 3, (4096,), generator=g).float()  # many ties at the maximum
    x[4, 10], x[4, 20] = float("nan"), float("nan")  # the first NaN wins
    x[5] = float("-inf")  # all -inf: index 0
    x[6, 0] = float("nan")
    x[7, 4095] = 1e30  # the last value
    x[8, 100] = float("inf")
    x[8, 200] = float("inf")
    x[9, 7] = 50.0
    x[9, 9] = float("nan")  # a NaN after the maximum still wins
    want = x.argmax(-1)
    assert torch.equal(argmax_rows_c(x), want)
    assert torch.equal(argmax_rows(x), want)
    assert want[3] == int((x[3] == 2).nonzero()[0]) and want[4] == 10 and want[5] == 0 and want[9] == 9


def test_strided_and_empty_rows() -> None:
    wide = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    assert torch.equal(argmax_rows_c(wide[:, 50:250]), wide[:, 50:250].argmax(-1))
    cols = wide.t()  # column stride != 1: copied first
    assert torch.equal(argmax_rows_c(cols), cols.argmax(-1))
    assert argmax_rows_c(torch.zeros(0, 8)).shape == (0,)


def test_refuses_what_it_does_not_take() -> None:
    with pytest.raises(ValueError, match="expected \\[M, V\\]"):
        argmax_rows_c(torch.zeros(8))
    with pytest.raises(ValueError, match="V >= 1"):
        argmax_rows_c(torch.zeros(2, 0))
    with pytest.raises(RuntimeError, match="CPU fp32 inference"):
        argmax_rows_c(torch.zeros(2, 8, dtype=torch.float64))


def test_auto_picks_it_on_the_c_backend() -> None:
    assert op("argmax_rows", "auto", CPU_INFERENCE) is argmax_rows_c
    assert op("argmax_rows", "auto", OpTarget(c_kernels=False)) is argmax_rows
