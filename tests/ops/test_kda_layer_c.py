"""A KDA layer's decode token in one C call (ops/kda/layer_c.py, ops/cpu/kda_decode.c openk3_kda_layer_decode): its output
and the conv windows and states it leaves equal the separate C calls it replaces (panel projections, the fused decode
kernel) bit for bit, and the definition's to fp32 rounding, for consecutive and scattered slots and fresh sequences;
"auto" takes it on the "c" backend."""

from __future__ import annotations

import pytest
import torch

from openk3.config import KDAGate
from openk3.ops.cpu.build import kernels_available
from openk3.ops.kda.decode_step import KDALayerWeights, KDASlots, kda_decode_step_fused
from openk3.ops.kda.layer_c import KDALayerDecodeWeights, kda_layer_decode_c, kda_layer_decode_reference
from openk3.ops.linear import _linear_panels_c, pack_panels
from openk3.ops.norm import rms_norm_c
from openk3.ops.registry import CPU_INFERENCE, OpTarget, registry

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the C kernels do not build here")
DM, H, D, W, S = 96, 2, 32, 4, 8
P = H * D


def weights(seed: int) -> KDALayerDecodeWeights:
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    norm = torch.rand(D, generator=g) + 0.5
    layer = KDALayerWeights(w(3 * P, W), torch.rand(H, generator=g), torch.randn(P, generator=g) * 0.1, KDAGate.LOWER_BOUND, -5.0,
                            lambda o: rms_norm_c(o, norm, 1e-6), norm, 1e-6)  # fmt: skip
    in_proj, f_b, o_proj = w(4 * P + D + H, DM), w(P, D), w(DM, P)
    return KDALayerDecodeWeights(in_proj, f_b, o_proj, layer, H, (pack_panels(in_proj), pack_panels(f_b), pack_panels(o_proj)))


def pools(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, H, D, D, generator=g) * 0.1, torch.randn(S, 3 * P, W - 1, generator=g)


def separate_calls(x: torch.Tensor, w: KDALayerDecodeWeights, slots: KDASlots) -> torch.Tensor:
    in_p, fb_p, o_p = w.panels  # type: ignore[misc]
    n = x.shape[0]
    qkv, f_a, gate, b = _linear_panels_c(x, in_p, 4 * P + D + H, n).split([3 * P, D, P, H], dim=-1)
    return _linear_panels_c(kda_decode_step_fused(qkv, _linear_panels_c(f_a, fb_p, P, n), b, gate, w.layer, slots), o_p, DM, n)


@pytest.mark.parametrize("slot_ids,fresh", [([0, 1, 2, 3], None), ([6, 2, 5], [False, True, False]), ([4], None)])
def test_equals_the_separate_calls_bit_for_bit_and_the_definition(slot_ids: list[int], fresh: list[bool] | None) -> None:
    w = weights(seed=len(slot_ids))
    x = torch.randn(len(slot_ids), DM, generator=torch.Generator().manual_seed(3))
    ids = torch.tensor(slot_ids)
    fresh_t = None if fresh is None else torch.tensor(fresh)
    results = []
    for step in (kda_layer_decode_c, separate_calls, kda_layer_decode_reference):
        state, conv = pools(seed=1)
        results.append((step(x, w, KDASlots(state, conv, ids, fresh_t, None)), state, conv))
    (y, state, conv), (y_sep, state_sep, conv_sep), (y_ref, state_ref, conv_ref) = results
    assert torch.equal(y, y_sep) and torch.equal(state, state_sep) and torch.equal(conv, conv_sep)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, state_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv, conv_ref)


def test_refusals_and_the_auto_rule() -> None:
    w = weights(seed=0)
    state, conv = pools(seed=0)
    x = torch.randn(2, DM)
    with pytest.raises(ValueError, match="slot ids span"):
        kda_layer_decode_c(x, w, KDASlots(state, conv, torch.tensor([0, S]), None, None))
    with pytest.raises(ValueError, match="laid out other than"):
        kda_layer_decode_c(torch.randn(2, DM + 1), w, KDASlots(state, conv, torch.tensor([0, 1]), None, None))
    with pytest.raises(ValueError, match="no panel copies"):
        kda_layer_decode_c(x, w._replace(panels=None), KDASlots(state, conv, torch.tensor([0, 1]), None, None))
    assert registry().get("kda_layer_decode", "auto", CPU_INFERENCE) is kda_layer_decode_c
    assert registry().get("kda_layer_decode", "auto", OpTarget(c_kernels=False)) is kda_layer_decode_reference
