"""An MLA layer's decode inputs in one C call (ops/mla/inputs_c.py, ops/cpu/mla_decode.c openk3_mla_decode_inputs): the
query, the projection output and the latent rows it writes equal the separate C calls (panel projections, C norms, a row
copy) bit for bit and the definition's to fp32 rounding, with and without an output gate; a row id outside the pool is
refused before anything is written; "auto" takes it on the "c" backend."""

from __future__ import annotations

import pytest
import torch

from openk3.ops.cpu.build import kernels_available
from openk3.ops.linear import _linear_panels_c, pack_panels
from openk3.ops.mla.inputs_c import MLAInputWeights, mla_decode_inputs_c, mla_decode_inputs_reference
from openk3.ops.norm import rms_norm_c
from openk3.ops.registry import CPU_INFERENCE, OpTarget, registry

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the C kernels do not build here")
DM, QA, LR, DR, Q, ROWS = 96, 48, 32, 16, 4 * 48, 40


def weights(gate: int, seed: int) -> MLAInputWeights:
    g = torch.Generator().manual_seed(seed)
    in_proj, q_b = torch.randn(QA + LR + DR + gate, DM, generator=g) / DM**0.5, torch.randn(Q, QA, generator=g) / QA**0.5
    return MLAInputWeights(
        in_proj, torch.rand(QA, generator=g) + 0.5, 1e-6, q_b, torch.rand(LR, generator=g) + 0.5, 1e-6, LR, DR, (pack_panels(in_proj), pack_panels(q_b))
    )


def separate_calls(x: torch.Tensor, w: MLAInputWeights, pool: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    in_p, qb_p = w.panels  # type: ignore[misc]
    t = x.shape[0]
    proj = _linear_panels_c(x, in_p, w.in_proj_WD.shape[0], t)
    q = _linear_panels_c(rms_norm_c(proj[:, :QA], w.q_a_norm, w.q_a_eps), qb_p, Q, t)
    pool.index_copy_(0, rows, torch.cat([rms_norm_c(proj[:, QA : QA + LR], w.kv_a_norm, w.kv_a_eps), proj[:, QA + LR : QA + LR + DR]], dim=-1))
    return q, proj


@pytest.mark.parametrize("gate", [0, 64])
@pytest.mark.parametrize("t", [1, 5, 16])
def test_equals_the_separate_calls_bit_for_bit_and_the_definition(gate: int, t: int) -> None:
    w = weights(gate, seed=t + gate)
    x = torch.randn(t, DM, generator=torch.Generator().manual_seed(t)) * 2
    rows = torch.randperm(ROWS, generator=torch.Generator().manual_seed(t + 1))[:t]
    results = []
    for step in (mla_decode_inputs_c, separate_calls, mla_decode_inputs_reference):
        pool = torch.randn(ROWS, LR + DR, generator=torch.Generator().manual_seed(9))
        results.append((*step(x, w, pool, rows), pool))
    (q, proj, pool), (q_sep, proj_sep, pool_sep), (q_ref, proj_ref, pool_ref) = results
    assert torch.equal(q, q_sep) and torch.equal(proj, proj_sep) and torch.equal(pool, pool_sep)
    torch.testing.assert_close(q, q_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool, pool_ref, rtol=1e-4, atol=1e-4)


def test_refusals_and_the_auto_rule() -> None:
    w = weights(0, seed=0)
    pool = torch.zeros(ROWS, LR + DR)
    with pytest.raises(ValueError, match="latent rows span"):
        mla_decode_inputs_c(torch.randn(2, DM), w, pool, torch.tensor([0, ROWS]))
    assert not pool.any()  # nothing written
    with pytest.raises(ValueError, match="no panel copies"):
        mla_decode_inputs_c(torch.randn(2, DM), w._replace(panels=None), pool, torch.tensor([0, 1]))
    assert registry().get("mla_decode_inputs", "auto", CPU_INFERENCE) is mla_decode_inputs_c
    assert registry().get("mla_decode_inputs", "auto", OpTarget(c_kernels=False)) is mla_decode_inputs_reference
