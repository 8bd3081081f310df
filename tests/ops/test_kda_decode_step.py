"""The KDA decode-step forms ("kda_decode": in_pool, fused, fla) against the naive form, over several steps on the same pools,
and the "auto" rule that pairs the decode form with the prefill form and the head size."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from openk3.config import KDAGate
from openk3.ops.cpu.build import kernels_available
from openk3.ops.kda import decode_step, fla_kernels
from openk3.ops.kda.decode_step import KDADecodeStep, KDALayerWeights, KDASlots
from openk3.ops.kda.naive import kda_recurrent
from openk3.ops.norm import rms_norm
from openk3.ops.registry import OpTarget, OpUse, registry

H, D, W, S = 2, 8, 4, 6
P = H * D
EPS = 1e-6


def weights(gate: KDAGate, g: torch.Generator) -> KDALayerWeights:
    norm_w = 1.0 + 0.1 * torch.randn(D, generator=g)
    lower = -5.0 if gate == KDAGate.LOWER_BOUND else None
    return KDALayerWeights(
        torch.randn(3 * P, W, generator=g) * 0.5, torch.randn(H, generator=g) * 0.3, torch.randn(P, generator=g) * 0.3, gate, lower,
        functools.partial(rms_norm, weight=norm_w, eps=EPS), norm_w, EPS,
    )  # fmt: skip


def fake_fla() -> SimpleNamespace:
    """fla.ops.kda's fused_recurrent_kda by its contract (V-first states), computed by openk3's recurrence on CPU."""

    def run(q, k, v, g, beta, *, scale, initial_state, output_final_state, state_v_first, cu_seqlens):  # type: ignore[no-untyped-def]
        o, state = kda_recurrent(q, k, v, g, beta, scale, initial_state.transpose(-1, -2), cu_seqlens)
        return o, state.transpose(-1, -2).contiguous()

    return SimpleNamespace(fused_recurrent_kda=run)


FORMS = ["in_pool", "fused", "fla"]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("gate", list(KDAGate))
@pytest.mark.parametrize("slots", [[1, 2, 3], [4, 0, 2]])  # consecutive (through a slice of the pool) or gathered
def test_form_equals_naive_over_steps(form: str, gate: KDAGate, slots: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    if form == "fused" and not kernels_available():
        pytest.skip("no C compiler: the kernel cannot be built here")
    if form == "fla":
        monkeypatch.setattr(fla_kernels, "_fla_kda", fake_fla)
    step: KDADecodeStep = getattr(decode_step, f"kda_decode_step_{form}")
    g = torch.Generator().manual_seed(len(form) + slots[0])
    w = weights(gate, g)
    pools = [(torch.randn(S, H, D, D, generator=g), torch.randn(S, 3 * P, W - 1, generator=g)) for _ in range(2)]
    pools[1] = (pools[0][0].clone(), pools[0][1].clone())
    ids = torch.tensor(slots)
    consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
    span = (slots[0], slots[0] + len(slots)) if consecutive else None
    with torch.no_grad():
        for t in range(3):
            fresh = torch.tensor([True, False, True]) if t == 0 else None  # fresh sequences read zeros, whatever the slot holds
            x, f, b, out_gate = (torch.randn(len(slots), n, generator=g) for n in (3 * P, P, H, P))
            want = decode_step.kda_decode_step_naive(x, f, b, out_gate, w, KDASlots(*pools[0], ids, fresh, span))
            got = step(x, f, b, out_gate, w, KDASlots(*pools[1], ids, fresh, span))
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            for mine, ref in zip(pools[1], pools[0], strict=True):
                torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5)  # the untouched slots too


@pytest.mark.parametrize("form", ["in_pool", "fused"])
def test_inference_forms_refuse_autograd(form: str) -> None:
    g = torch.Generator().manual_seed(0)
    w = weights(KDAGate.SOFTPLUS, g)
    x = torch.randn(1, 3 * P, requires_grad=True)
    slots = KDASlots(torch.zeros(S, H, D, D), torch.zeros(S, 3 * P, W - 1), torch.tensor([0]), None, (0, 1))
    with pytest.raises(RuntimeError, match=f"the KDA form '{form}' is inference-only"):
        getattr(decode_step, f"kda_decode_step_{form}")(x, torch.zeros(1, P), torch.zeros(1, H), torch.zeros(1, P), w, slots)


def decode_form(prefill: str, target: OpTarget, head_dim: int = 128) -> str:
    return registry().entry("kda_decode", "auto", target, OpUse(paired_with=prefill, head_dim=head_dim))[0]


def test_auto_pairs_the_decode_form_with_the_prefill_and_the_head_size() -> None:
    c = "c" in OpTarget().backends()
    assert decode_form("naive", OpTarget()) == "naive"  # the definitions on every kind of step
    assert decode_form("autograd", OpTarget(training=True)) == "naive"  # the differentiable one
    assert decode_form("mixed", OpTarget()) == ("fused" if c else "in_pool")
    assert decode_form("mixed", OpTarget(), head_dim=1024) == "in_pool"  # past the fused kernel's stack arrays
    assert decode_form("mixed", OpTarget(c_kernels=False)) == "in_pool"
    assert decode_form("mixed", OpTarget(dtype=torch.bfloat16)) == "in_pool"
    assert decode_form("mixed", OpTarget("cuda")) == "in_pool"
    assert decode_form("fla", OpTarget("cuda")) == decode_form("fla_recurrent", OpTarget("cuda")) == "fla"
    entry: Any = registry().entry("kda_decode", "fla", OpTarget("cuda"))[1]
    assert entry.requires == ("fla.ops.kda",) and entry.backend == "cuda"
