"""Packed MXFP4 experts in one C call (ops/moe/packed_c.py, ops/cpu/moe.c, the products in ops/cpu/mxfp4_rows.h): equal to
the grouped torch form over the same bank (which decodes each expert with ops/mxfp4.py's dequantize) up to the products'
fp32 rounding, for one token and for verification- and batch-sized steps, with the model's widths and both activations;
bit for bit equal to the dense C expert loop over the dequantized bank (the weights are decoded in registers, the sums
are the same); "auto" takes it on the "c" backend, for a decode step of one token and of many."""

from __future__ import annotations

import functools

import pytest
import torch

from openk3.config import Activation
from openk3.ops.activation import glu
from openk3.ops.cpu.build import kernels_available
from openk3.ops.moe import moe_experts_grouped, moe_experts_naive
from openk3.ops.moe.cpu_pairs import moe_experts_batched_c
from openk3.ops.moe.packed_bank import PackedMXFP4ExpertBank
from openk3.ops.moe.packed_c import moe_experts_packed_c, packed_c_fits
from openk3.ops.registry import CPU_INFERENCE, op

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the C kernels do not build here")
ACTS = {"silu": functools.partial(glu, kind=Activation.SILU), "situ": functools.partial(glu, kind=Activation.SITU, beta=4.0, linear_beta=25.0)}


def packed_bank(e: int, d: int, i: int, seed: int) -> PackedMXFP4ExpertBank:
    g = torch.Generator().manual_seed(seed)
    return PackedMXFP4ExpertBank.from_dense(
        torch.randn(e, i, d, generator=g) / d**0.5, torch.randn(e, i, d, generator=g) / d**0.5, torch.randn(e, d, i, generator=g) / i**0.5
    )


def routing(t: int, e: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]), torch.rand(t, k, generator=g)


@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("t", [1, 3, 16, 70])
@pytest.mark.parametrize("d,i", [(128, 128), (64, 96)])
def test_equals_the_grouped_torch_form(act: str, t: int, d: int, i: int) -> None:
    bank = packed_bank(16, d, i, seed=t + d)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(t)) * 2
    idx, w = routing(t, 16, 4, seed=t)
    assert packed_c_fits(x, bank, ACTS[act])
    want = moe_experts_grouped(x, idx, w, bank, ACTS[act])
    got = moe_experts_packed_c(x, idx, w, bank, ACTS[act])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    exact = moe_experts_naive(x.double(), idx, w, bank.materialize(torch.float64), ACTS[act])
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("t", [1, 5, 16, 70])
@pytest.mark.parametrize("d,i", [(128, 128), (64, 96), (256, 32)])
def test_equals_the_dense_c_loop_on_the_decoded_bank_bit_for_bit(act: str, t: int, d: int, i: int) -> None:
    bank = packed_bank(16, d, i, seed=t + i)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(t + 1)) * 3
    idx, w = routing(t, 16, 4, seed=t + 2)
    got = moe_experts_packed_c(x, idx, w, bank, ACTS[act])
    assert torch.equal(got, moe_experts_batched_c(x, idx, w, bank.materialize(torch.float32), ACTS[act]))


@pytest.mark.parametrize("t", [1, 3, 16])
def test_auto_takes_it_for_packed_banks_and_refuses_what_it_does_not_know(t: int) -> None:
    bank = packed_bank(8, 64, 64, seed=1)
    x = torch.randn(t, 64, generator=torch.Generator().manual_seed(2))
    idx, w = routing(t, 8, 2, seed=3)
    auto = op("moe_experts", "auto", CPU_INFERENCE)
    assert torch.equal(auto(x, idx, w, bank, ACTS["silu"]), moe_experts_packed_c(x, idx, w, bank, ACTS["silu"]))
    assert not packed_c_fits(x, bank, lambda gate, up: gate * up)  # another activation: the torch forms
    assert not packed_c_fits(x.double(), bank, ACTS["silu"])
    with pytest.raises(ValueError, match="expert ids"):
        moe_experts_packed_c(x, idx + 8, w, bank, ACTS["silu"])
