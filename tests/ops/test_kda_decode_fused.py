"""The fused CPU KDA decode kernel (ops/cpu/kda_decode.c via ops/kda/decode_fused.py) against the torch ops it replaces."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from openk3.config import KDAGate
from openk3.ops.cpu.build import kernels_available
from openk3.ops.kda import decode_fused
from openk3.ops.kda.decode_fused import kda_decode_fused
from openk3.ops.kda.decode_inplace import kda_decode_
from openk3.ops.kda.gate import kda_gate
from openk3.ops.norm import l2_norm, rms_norm
from openk3.ops.short_conv import causal_conv1d_update_

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C compiler: the kernel cannot be built here")

H, D = 3, 16
P = H * D
EPS = 1e-6


def reference_step(
    x: torch.Tensor,
    conv_w: torch.Tensor,
    conv_pool: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor | None,
    f: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    b: torch.Tensor,
    state_pool: torch.Tensor,
    gate_kind: KDAGate,
    lower_bound: float | None,
    norm_w: torch.Tensor,
    gate: torch.Tensor,
) -> torch.Tensor:
    """model/kda.py's torch ops for one decode token, on gathered slots written back (pools modified in place)."""
    n = slots.numel()
    windows, states = conv_pool[slots].clone(), state_pool[slots].clone()
    if fresh is not None:
        windows[fresh], states[fresh] = 0.0, 0.0
    qkv = causal_conv1d_update_(x, conv_w, windows, "silu").view(n, 3, H, D)
    q, k = l2_norm(qkv[:, :2]).unbind(1)
    g = kda_gate(f.view(n, H, D), A_log, dt_bias, gate_kind, lower_bound)
    o = kda_decode_(q, k, qkv[:, 2], g, torch.sigmoid(b), states)
    conv_pool[slots], state_pool[slots] = windows, states
    return (rms_norm(o, norm_w, EPS) * torch.sigmoid(gate.view(n, H, D))).reshape(n, P)


@pytest.mark.parametrize("gate_kind", [KDAGate.SOFTPLUS, KDAGate.LOWER_BOUND])
@pytest.mark.parametrize("width", [4, 3])  # the spelled-out width-4 loop and the general one
@pytest.mark.parametrize("slots", [[0, 1, 2], [4, 0, 2], [7, 1, 5, 0, 9, 3, 2, 8]])  # the last: 24 (sequence, head) pairs, split over threads
def test_kernel_equals_torch_ops_over_several_steps(gate_kind: KDAGate, width: int, slots: list[int]) -> None:
    g = torch.Generator().manual_seed(width)
    rand = lambda *shape: torch.randn(*shape, generator=g)
    n, num_slots = len(slots), max(slots) + 2
    conv_w, A_log, dt_bias, norm_w = rand(3 * P, width) * 0.5, rand(H) * 0.5, rand(P), rand(D).abs() + 0.5
    pools = [rand(num_slots, 3 * P, width - 1), rand(num_slots, H, D, D) * 0.1]
    ref_pools = [t.clone() for t in pools]
    slot_ids = torch.tensor(slots)
    lower_bound = -5.0 if gate_kind == KDAGate.LOWER_BOUND else None
    for step in range(4):
        fresh = torch.tensor([step == 0 and i == 1 for i in range(n)])  # a new sequence on a dirty slot, first step only
        proj = rand(n, 3 * P + H + 7) * 2  # x and b are column blocks of one wider projection output, as in the model
        x, b = proj[:, : 3 * P], proj[:, 3 * P : 3 * P + H]
        f, gate = rand(n, P) * 3, rand(n, P)
        with torch.inference_mode():
            got = kda_decode_fused(x, conv_w, pools[0], slot_ids, fresh, f, A_log, dt_bias, b, pools[1], gate_kind, lower_bound, norm_w, EPS, gate)
            want = reference_step(x, conv_w, ref_pools[0], slot_ids, fresh, f, A_log, dt_bias, b, ref_pools[1], gate_kind, lower_bound, norm_w, gate)
        assert got is not None
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pools[1], ref_pools[1], rtol=1e-5, atol=1e-6)
        assert torch.equal(pools[0], ref_pools[0])  # windows hold inputs, copied exactly
    untouched = [s for s in range(num_slots) if s not in slots]
    assert torch.equal(pools[1][untouched], ref_pools[1][untouched])


class FusedArgs(NamedTuple):
    """kda_decode_fused's arguments, in its order."""

    x_pre_NC: torch.Tensor
    conv_weight_CW: torch.Tensor
    conv_pool_SCW: torch.Tensor
    slots_N: torch.Tensor
    fresh_N: torch.Tensor | None
    f_NP: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    b_NH: torch.Tensor
    state_pool_SHDD: torch.Tensor
    gate_kind: KDAGate
    lower_bound: float | None
    norm_weight_D: torch.Tensor
    norm_eps: float
    out_gate_NP: torch.Tensor


def _args(n: int = 2, dtype: torch.dtype = torch.float32, heads: int = H, dim: int = D) -> FusedArgs:
    """A call the kernel takes (fp32): n sequences on a pool of 4 slots, conv width 4."""
    p = heads * dim
    return FusedArgs(
        torch.randn(n, 3 * p, dtype=dtype), torch.randn(3 * p, 4, dtype=dtype), torch.zeros(4, 3 * p, 3, dtype=dtype), torch.arange(n), None,
        torch.randn(n, p, dtype=dtype), torch.zeros(heads, dtype=dtype), torch.zeros(p, dtype=dtype), torch.randn(n, heads, dtype=dtype),
        torch.zeros(4, heads, dim, dim, dtype=dtype), KDAGate.SOFTPLUS, None, torch.ones(dim, dtype=dtype), EPS, torch.randn(n, p, dtype=dtype),
    )  # fmt: skip


def test_refuses_what_it_cannot_take_without_touching_anything() -> None:
    """Chosen once for CPU fp32 inference (the "c" backend), it never quietly declines: another dtype, a layout other than
    the layer's, a head wider than its stack arrays (the layer chooses the torch ops for those) or autograd on is an error,
    and nothing is written."""
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="kda decode: .* chosen for CPU fp32 inference, but got torch.float64"):
            kda_decode_fused(*_args(dtype=torch.float64))
        args = _args()
        args = args._replace(x_pre_NC=args.x_pre_NC.t().contiguous().t())  # x with a non-unit inner stride
        before = args.state_pool_SHDD.clone()
        with pytest.raises(ValueError, match="laid out other than the KDA layer"):
            kda_decode_fused(*args)
        assert torch.equal(args.state_pool_SHDD, before)
        args = _args()._replace(dt_bias=torch.zeros(D, H).t())  # dt_bias [H, D] as a transposed view: the kernel reads flat arrays
        with pytest.raises(ValueError, match="laid out other than the KDA layer"):
            kda_decode_fused(*args)
        big = decode_fused.MAX_HEAD_DIM + 1
        with pytest.raises(ValueError, match=f"head dim {big} of at most {big - 1}"):
            kda_decode_fused(*_args(heads=1, dim=big))
    args = _args()
    with pytest.raises(RuntimeError, match="with autograd on"):
        kda_decode_fused(*args._replace(f_NP=args.f_NP.requires_grad_()))


def test_slot_ids_outside_the_pools_are_refused() -> None:
    args = _args()._replace(slots_N=torch.tensor([0, 4]))  # the pools have 4 slots
    with torch.inference_mode(), pytest.raises(ValueError, match="slot ids span 0..4"):
        kda_decode_fused(*args)


def test_unknown_home_means_no_kernel_not_an_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Containers with an arbitrary uid have no home directory: without OPENK3_CACHE_DIR the kernels are simply off."""
    from openk3.ops.cpu import build

    def no_home() -> None:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("OPENK3_CACHE_DIR", raising=False)
    monkeypatch.setattr(build.Path, "home", staticmethod(no_home))
    build.load.cache_clear()
    try:
        with pytest.warns(UserWarning, match="home directory"):
            assert build.load("norm.c") is None
        monkeypatch.setenv("OPENK3_CACHE_DIR", str(tmp_path))
        build.load.cache_clear()
        assert build.load("norm.c") is not None
    finally:
        build.load.cache_clear()


def test_switched_off_by_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from openk3.ops.cpu import build

    monkeypatch.setenv("OPENK3_CPU_KERNELS", "0")
    build.load.cache_clear()
    try:
        assert build.load("kda_decode.c") is None
    finally:
        monkeypatch.delenv("OPENK3_CPU_KERNELS")
        build.load.cache_clear()
    monkeypatch.setenv("OPENK3_CACHE_DIR", str(tmp_path))  # an empty cache: built again, into it
    try:
        lib = build.load("kda_decode.c")
        assert lib is not None and lib.openk3_kda_decode_step is not None
        assert [p.name.split("-")[0] for p in (tmp_path / "kernels").glob("*.so")] == ["kda_decode"]
    finally:
        build.load.cache_clear()
