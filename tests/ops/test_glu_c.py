"""The gated MLP activation in C (ops/glu_c.py, ops/cpu/glu.c): equal to ops/activation.py's glu to fp32 rounding for SiLU
and SiTU, on strided pieces of one fused output and leading batch shapes; "auto" takes it for CPU fp32 inference and the
torch definition for training (model/layers.py's GatedMLP selects it)."""

from __future__ import annotations

import pytest
import torch

from openk3.config import Activation
from openk3.model.layers import GatedMLP
from openk3.ops.activation import glu
from openk3.ops.cpu.build import kernels_available
from openk3.ops.glu_c import glu_c
from openk3.ops.registry import CPU_INFERENCE, OpTarget, op

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the C kernels do not build here")


@pytest.mark.parametrize("kind", list(Activation))
@pytest.mark.parametrize("shape", [(1, 7), (16, 256), (2, 3, 96)])
def test_equals_the_definition(kind: Activation, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    gate, up = torch.randn(shape, generator=g) * 8, torch.randn(shape, generator=g) * 40  # past both tanh knees
    torch.testing.assert_close(glu_c(gate, up, kind, 4.0, 25.0), glu(gate, up, kind, 4.0, 25.0), rtol=2e-6, atol=2e-6)


def test_strided_pieces_of_one_fused_output() -> None:
    fused = torch.randn(5, 2 * 64, generator=torch.Generator().manual_seed(1))
    gate, up = fused.split(64, dim=-1)
    torch.testing.assert_close(glu_c(gate, up, Activation.SITU), glu(gate, up, Activation.SITU), rtol=2e-6, atol=2e-6)
    column = torch.randn(64, 5, generator=torch.Generator().manual_seed(2)).t()  # a non-unit last stride is copied first
    torch.testing.assert_close(glu_c(column, column, Activation.SILU), glu(column, column, Activation.SILU), rtol=2e-6, atol=2e-6)
    assert glu_c(torch.empty(0, 8), torch.empty(0, 8), Activation.SILU).shape == (0, 8)


def test_refuses_what_it_does_not_take() -> None:
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="differ"):
        glu_c(x, torch.zeros(2, 4), Activation.SILU)
    with pytest.raises(RuntimeError, match="CPU fp32 inference"):
        glu_c(x.double(), x.double(), Activation.SILU)


def test_auto_by_target_and_the_mlp_selects_it() -> None:
    assert op("glu", "auto", CPU_INFERENCE) is glu_c
    assert op("glu", "auto", OpTarget(training=True)) is glu
    mlp = GatedMLP(32, 64, Activation.SITU)
    assert mlp.glu is glu_c
    mlp.select(OpTarget(training=True))
    assert mlp.glu is glu
