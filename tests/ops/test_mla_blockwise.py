"""MLA prefill by key blocks (ops/mla/blockwise.py) against the expanded reference: block edges on both sides of the
first query, one block, blocks of one key, and the gradient the training path takes through it."""

from __future__ import annotations

import pytest
import torch

from openk3.ops.mla import mla_expanded
from openk3.ops.mla.blockwise import mla_blockwise
from openk3.ops.registry import OpTarget, op
from tests.ops.test_mla import make


@pytest.mark.parametrize("t,s,block", [(1, 1, 4), (5, 5, 2), (4, 9, 3), (1, 17, 4), (9, 30, 7), (6, 6, 100), (3, 8, 1)])
def test_blockwise_equals_expanded(t: int, s: int, block: int) -> None:
    q_nope, q_pe, c, k_pe, w_uk, w_uv = make(t, s)
    want = mla_expanded(q_nope, q_pe, c, k_pe, w_uk, w_uv, 0.2, s - t)
    torch.testing.assert_close(mla_blockwise(q_nope, q_pe, c, k_pe, w_uk, w_uv, 0.2, s - t, block), want, atol=1e-5, rtol=1e-5)


def test_blockwise_gradient_equals_expanded() -> None:
    q_nope, q_pe, c, k_pe, w_uk, w_uv = inputs = [x.requires_grad_() for x in make(4, 11, seed=2)]
    want = torch.autograd.grad(mla_expanded(q_nope, q_pe, c, k_pe, w_uk, w_uv, 0.2, 7).square().sum(), inputs)
    got = torch.autograd.grad(mla_blockwise(q_nope, q_pe, c, k_pe, w_uk, w_uv, 0.2, 7, 3).square().sum(), inputs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_registered_by_name() -> None:
    assert op("mla_prefill", "blockwise", OpTarget(training=True)).__name__ == "mla_blockwise"
    with pytest.raises(ValueError, match="block_keys"):
        q_nope, q_pe, c, k_pe, w_uk, w_uv = make(1, 1)
        mla_blockwise(q_nope, q_pe, c, k_pe, w_uk, w_uv, 0.2, 0, 0)
