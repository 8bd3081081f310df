"""The conftest's poisoning is on in this folder, and every call form of the allocators still works through it."""

from __future__ import annotations

import pytest
import torch

from tests.ops.conftest import poison_


def test_floating_allocations_are_nan_in_every_call_form() -> None:
    base = torch.zeros(2, 3, 4)
    made = [
        torch.empty(2, 3),
        torch.empty((2, 3)),
        torch.empty([2, 3], dtype=torch.bfloat16),
        torch.empty(torch.Size([2, 3]), dtype=torch.float64, device="cpu"),
        torch.empty(1, 2, 3, 4, memory_format=torch.channels_last),
        torch.empty_like(base),
        torch.empty_like(base.transpose(0, 2), memory_format=torch.preserve_format),
        torch.empty_like(base, dtype=torch.float16),
        torch.empty_strided((2, 3), (1, 2)),
        base.new_empty(5),
        base.new_empty((5, 2)),
        base.new_empty([5], dtype=torch.complex64),
        base.new_empty_strided((2, 2), (2, 1)),
    ]
    if hasattr(torch, "empty_permuted"):
        made.append(torch.empty_permuted((2, 3, 4), (2, 0, 1)))
    for t in made:
        assert t.numel() > 0 and torch.isnan(t).all(), (t.shape, t.dtype)
    assert made[6].stride() == base.transpose(0, 2).stride()
    assert made[4].is_contiguous(memory_format=torch.channels_last)


def test_out_and_requires_grad_pass_through() -> None:
    out = torch.zeros(3)
    assert torch.empty(3, out=out) is out and torch.isnan(out).all()
    leaf = torch.empty(4, requires_grad=True)
    assert leaf.requires_grad and leaf.is_leaf and torch.isnan(leaf.detach()).all()


@pytest.mark.parametrize(("dtype", "value"), [(torch.int64, -1), (torch.int32, -1), (torch.int8, -1), (torch.uint8, 255), (torch.bool, True)])
def test_integer_and_bool_allocations_are_all_ones(dtype: torch.dtype, value: int | bool) -> None:
    assert (torch.empty(3, dtype=dtype) == value).all()
    assert (torch.zeros(2).new_empty(3, dtype=dtype) == value).all()


def test_poison_leaves_empty_and_sparse_tensors_alone() -> None:
    assert poison_(torch.zeros(0)).numel() == 0
    sparse = torch.zeros(2, 2).to_sparse()
    assert poison_(sparse) is sparse and sparse._nnz() == 0
