"""Router and routed experts: grouped == batched == naive, selection-only bias, bank access pattern, input errors. Every
form is the registry's entry for a target (ops/registry.py), with the C loops ("c" backend) and without them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import cast

import pytest
import torch

from openk3.config import Activation
from openk3.ops.activation import glu
from openk3.ops.cpu.build import kernels_available
from openk3.ops.moe import (
    DenseExpertBank,
    ExpertWeights,
    MoEExpertsFn,
    cpu_pairs,
    moe_experts_batched,
    moe_experts_grouped,
    moe_experts_naive,
    moe_experts_single_token,
    moe_experts_sized,
    sigmoid_topk_route,
)
from openk3.ops.moe.router import RouterFn
from openk3.ops.registry import OpTarget, op

ACTS = {kind.value: functools.partial(glu, kind=kind) for kind in Activation}
NO_C = pytest.mark.skipif(not kernels_available(), reason="no C compiler: the C loops cannot be built here")


@pytest.fixture(autouse=True, params=[pytest.param("C loops", marks=NO_C), "torch ops"])
def pair_bookkeeping(request: pytest.FixtureRequest) -> str:
    """On CPU the router's top-k and the batched path's pair bookkeeping run as C loops (ops/moe/cpu_pairs.py, the "c"
    backend); every test here runs with them and with the torch ops they replace."""
    return str(request.param)


def target(pair_bookkeeping: str, dtype: torch.dtype = torch.float32) -> OpTarget:
    return OpTarget(dtype=dtype, c_kernels=pair_bookkeeping == "C loops")


def forms(pair_bookkeeping: str, dtype: torch.dtype = torch.float32) -> dict[str, MoEExpertsFn]:
    """The registry's fast routed-expert forms for this backend and dtype."""
    t = target(pair_bookkeeping, dtype)
    names = {"grouped": "fast", "batched": "batched", "auto": "auto", "static": "static"}
    return {form: op("moe_experts", name, t) for form, name in names.items()}


@pytest.fixture
def route(pair_bookkeeping: str) -> RouterFn:
    return op("moe_route", "auto", target(pair_bookkeeping))


# For the tests of the C loops themselves (against the torch ops, inside the function): the autouse fixture's "C loops" case only.
c_loops_only = pytest.mark.parametrize("pair_bookkeeping", ["C loops"], indirect=True)


@c_loops_only
def test_c_router_equals_torch_router_at_scale(route: RouterFn) -> None:
    """Many experts and a large k (the K3 shape scaled down): same choices in the same order, same weights and scores
    (random logits: no ties, whose order torch.topk leaves open)."""
    g = torch.Generator().manual_seed(7)
    x, weight, bias = torch.randn(40, 32, generator=g), torch.randn(96, 32, generator=g), 0.3 * torch.randn(96, generator=g)
    assert route is not sigmoid_topk_route
    with torch.inference_mode():
        got = route(x, weight, bias, 16, True, 2.5)
        want = sigmoid_topk_route(x, weight, bias, k=16, renormalize=True, scaling=2.5)
    assert torch.equal(got.topk_idx, want.topk_idx)
    torch.testing.assert_close(got.topk_weight, want.topk_weight, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.scores, want.scores, rtol=1e-6, atol=1e-7)


@c_loops_only
@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("d,i", [(256, 128), (37, 19)])
def test_c_expert_loop_matches_naive(monkeypatch: pytest.MonkeyPatch, act: str, d: int, i: int) -> None:
    """The batched path's expert MLPs as one C loop (ops/cpu/moe.c): the model's widths (whole vectors) and odd ones (a scalar
    tail whatever the vector width), 1 to ~15 rows per expert (every row-tile shape), and inputs from near 0 to deep in SiLU's and SiTU's saturation."""

    def no_batched_products(*args: object) -> None:
        raise AssertionError("the batched products ran: the C expert loop should have done the experts")

    monkeypatch.setattr(cpu_pairs, "bmm_weight_t", no_batched_products)
    t, e, k = 37, 16, 4
    bank = _bank(e, d, i, seed=d)
    g = torch.Generator().manual_seed(i)
    x = torch.randn(t, d, generator=g) * torch.logspace(-4, 1.5, t).unsqueeze(1)
    idx, w = _routing(t, e, k, seed=3)
    bank64 = DenseExpertBank(bank.w1_EID.double(), bank.w3_EID.double(), bank.w2_EDI.double())
    exact = moe_experts_naive(x.double(), idx, w, bank64, ACTS[act])
    got = forms("C loops")["batched"](x, idx, w, bank, ACTS[act])
    torch_fp32 = moe_experts_naive(x, idx, w, bank, ACTS[act])

    def error(y: torch.Tensor) -> float:  # relative to each token's largest output: the rows span six orders of magnitude
        return float(((y.double() - exact).abs() / exact.abs().amax(1, keepdim=True)).max())

    assert error(got) < max(2 * error(torch_fp32), 1e-6), (error(got), error(torch_fp32))


def test_c_expert_loop_takes_only_the_glu_it_knows() -> None:
    assert cpu_pairs._glu_in_c(functools.partial(glu, kind=Activation.SILU)) == (0, 4.0, 25.0)
    assert cpu_pairs._glu_in_c(functools.partial(glu, kind=Activation.SITU, beta=3.0, linear_beta=10.0)) == (1, 3.0, 10.0)
    untyped_glu = cast(Callable[..., torch.Tensor], glu)  # the next partial passes glu a keyword it lacks, on purpose
    assert cpu_pairs._glu_in_c(functools.partial(untyped_glu, kind=Activation.SILU, out=None)) is None  # an argument it does not know
    assert cpu_pairs._glu_in_c(lambda gate, up: gate * up) is None  # any other callable: torch between the batched products


class CountingBank:
    """Wraps a bank and records which experts were requested, in order."""

    def __init__(self, inner: DenseExpertBank) -> None:
        self.inner = inner
        self.requested: list[int] = []

    @property
    def num_experts(self) -> int:
        return self.inner.num_experts

    def expert(self, e: int, dtype: torch.dtype) -> ExpertWeights:
        self.requested.append(e)
        return self.inner.expert(e, dtype)


def _bank(e: int, d: int, i: int, seed: int) -> DenseExpertBank:
    g = torch.Generator().manual_seed(seed)
    return DenseExpertBank(torch.randn(e, i, d, generator=g) / d**0.5, torch.randn(e, i, d, generator=g) / d**0.5, torch.randn(e, d, i, generator=g) / i**0.5)


def _routing(t: int, e: int, k: int, seed: int, experts: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct random experts per token drawn from the first `experts` ids (so the rest get zero tokens)."""
    g = torch.Generator().manual_seed(seed)
    pool = experts or e
    idx = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k, dtype=torch.int64)
    return idx, torch.rand(t, k, generator=g)


FAST = ["auto", "batched", "grouped", "static"]


@pytest.mark.parametrize("fast", FAST)
@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("t,e,k,used", [(1, 4, 1, 4), (9, 8, 2, 5), (33, 6, 6, 6), (20, 16, 4, 7), (64, 5, 3, 5), (8, 64, 2, 64)])
def test_fast_paths_match_naive_fp32(pair_bookkeeping: str, fast: str, act: str, t: int, e: int, k: int, used: int) -> None:
    """(8, 64, 2, 64): few active experts out of many, so the batched path gathers the active experts' weights."""
    d, i = 24, 16
    bank = _bank(e, d, i, seed=t + e)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(t)) * 3
    idx, w = _routing(t, e, k, seed=k, experts=used)
    want = moe_experts_naive(x, idx, w, bank, ACTS[act])
    got = forms(pair_bookkeeping)[fast](x, idx, w, bank, ACTS[act])
    assert got.dtype == torch.float32 and got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", sorted(ACTS))
def test_naive_matches_per_token_transcription(act: str) -> None:
    t, e, k, d, i = 6, 5, 3, 8, 12
    bank = _bank(e, d, i, seed=2)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(3))
    idx, w = _routing(t, e, k, seed=4)
    want = torch.zeros(t, d, dtype=torch.float64)
    for tok in range(t):
        for j in range(k):
            w1, w3, w2 = (m.double() for m in bank.expert(int(idx[tok, j]), torch.float32))
            h = ACTS[act]((w1 @ x[tok].double()).unsqueeze(0), (w3 @ x[tok].double()).unsqueeze(0)).squeeze(0)
            want[tok] += float(w[tok, j]) * (w2 @ h)
    torch.testing.assert_close(moe_experts_naive(x, idx, w, bank, ACTS[act]).double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fast", FAST)
@pytest.mark.parametrize("act", sorted(ACTS))
def test_fast_paths_match_naive_bf16(pair_bookkeeping: str, fast: str, act: str) -> None:
    t, e, k, d, i = 40, 8, 4, 64, 32
    bank = _bank(e, d, i, seed=5)
    x = torch.randn(t, d, generator=torch.Generator().manual_seed(6)).bfloat16()
    idx, w = _routing(t, e, k, seed=7, experts=6)
    want = moe_experts_naive(x, idx, w, bank, ACTS[act])
    got = forms(pair_bookkeeping, torch.bfloat16)[fast](x, idx, w, bank, ACTS[act])
    assert got.dtype == torch.bfloat16
    # Same bf16 matmuls on the same rows, fp32 accumulation in a different order: at most a rounding step apart.
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    ref = moe_experts_naive(x.float(), idx, w, bank, ACTS[act])
    torch.testing.assert_close(got.float(), ref, rtol=5e-2, atol=5e-2)


def test_only_experts_with_tokens_are_requested() -> None:
    e = 10
    bank = _bank(e, 8, 8, seed=1)
    idx = torch.tensor([[7, 2], [2, 9], [7, 9]])
    w = torch.ones(3, 2)
    x = torch.randn(3, 8)
    counting = CountingBank(bank)
    moe_experts_grouped(x, idx, w, counting, ACTS["silu"])
    assert counting.requested == [2, 7, 9]
    naive_counting = CountingBank(bank)
    moe_experts_naive(x, idx, w, naive_counting, ACTS["silu"])
    assert naive_counting.requested == [2, 7, 9]


def test_no_tokens_and_zero_weights(pair_bookkeeping: str) -> None:
    moe_experts_batched = forms(pair_bookkeeping)["batched"]
    bank = CountingBank(_bank(4, 8, 8, seed=1))
    empty = moe_experts_grouped(torch.zeros(0, 8), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2), bank, ACTS["situ"])
    assert empty.shape == (0, 8) and bank.requested == []
    x = torch.randn(3, 8)
    idx = torch.tensor([[0, 1], [1, 2], [3, 0]])
    assert torch.equal(moe_experts_grouped(x, idx, torch.zeros(3, 2), bank, ACTS["situ"]), torch.zeros(3, 8))
    assert torch.equal(moe_experts_batched(x, idx, torch.zeros(3, 2), bank.inner, ACTS["situ"]), torch.zeros(3, 8))
    no_tokens = moe_experts_batched(torch.zeros(0, 8), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2), bank.inner, ACTS["situ"])
    assert no_tokens.shape == (0, 8)


def test_int32_expert_ids(pair_bookkeeping: str) -> None:
    bank = _bank(4, 8, 8, seed=2)
    x = torch.randn(5, 8)
    idx, w = _routing(5, 4, 2, seed=3)
    want = moe_experts_naive(x, idx, w, bank, ACTS["silu"])
    for fn in (moe_experts_naive, *forms(pair_bookkeeping).values()):
        torch.testing.assert_close(fn(x, idx.int(), w, bank, ACTS["silu"]), want, rtol=1e-5, atol=1e-5)


def test_dispatch_by_name_and_backend() -> None:
    train = OpTarget(training=True)  # plain torch ops, differentiable
    assert op("moe_experts", "naive") is moe_experts_naive
    assert op("moe_experts", "batched", train) is moe_experts_batched
    for name, fn in (("fast", moe_experts_grouped), ("sized", moe_experts_sized), ("auto", moe_experts_sized)):
        form = op("moe_experts", name, train)
        assert isinstance(form, functools.partial) and form.func is fn, name
    if kernels_available():
        assert op("moe_experts", "batched") is cpu_pairs.moe_experts_batched_c
        auto = op("moe_experts", "auto")
        assert isinstance(auto, functools.partial) and auto.keywords["batched_c"] is cpu_pairs.moe_experts_batched_c


def test_dispatch_unknown_name() -> None:
    with pytest.raises(ValueError, match=r"'cutlass' is unknown: expected one of \['batched', 'fast', 'naive', 'sized', 'static', 'triton', 'auto'\]"):
        op("moe_experts", "cutlass")


@pytest.mark.parametrize(
    "t,with_c_loop,with_torch_ops",
    [
        (1, "batched", "single"),
        (2, "batched", "grouped"),
        (8, "batched", "batched"),
        (65, "batched", "grouped"),
        (256, "batched", "grouped"),
        (257, "grouped", "grouped"),
    ],
)
def test_auto_picks_batched_only_for_small_steps_on_dense_banks(pair_bookkeeping: str, t: int, with_c_loop: str, with_torch_ops: str) -> None:
    """k=2, E=8. With the expert MLPs in C: batched for 1 <= pairs <= 64 * 8. With torch ops: one token alone, batched for
    16 <= pairs <= 16 * 8. A bank that is not a DenseExpertBank always goes grouped."""
    expect = with_c_loop if pair_bookkeeping == "C loops" else with_torch_ops
    linear = op("linear", "auto", target(pair_bookkeeping))  # the products of the per-expert forms on this backend
    paths: dict[str, MoEExpertsFn] = {**forms(pair_bookkeeping), "single": functools.partial(moe_experts_single_token, linear=linear)}
    moe_experts_auto = paths["auto"]
    bank = _bank(8, 16, 8, seed=3)
    x = torch.randn(t, 16, generator=torch.Generator().manual_seed(1))
    idx, w = _routing(t, 8, 2, seed=2)
    assert torch.equal(moe_experts_auto(x, idx, w, bank, ACTS["silu"]), paths[expect](x, idx, w, bank, ACTS["silu"]))
    counting = CountingBank(bank)
    grouped = paths["grouped"] if t > 1 else paths["single"]
    assert torch.equal(moe_experts_auto(x, idx, w, counting, ACTS["silu"]), grouped(x, idx, w, bank, ACTS["silu"]))


@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_token_matches_naive_and_asks_only_for_its_experts(pair_bookkeeping: str, act: str, dtype: torch.dtype) -> None:
    bank = _bank(12, 16, 8, seed=4)
    x = torch.randn(1, 16, generator=torch.Generator().manual_seed(5)).to(dtype)
    idx, w = torch.tensor([[9, 2, 7]]), torch.tensor([[0.5, 0.3, 0.2]])
    counting = CountingBank(bank)
    got = moe_experts_single_token(x, idx, w, counting, ACTS[act])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), moe_experts_naive(x, idx, w, bank, ACTS[act]).float(), rtol=tol, atol=tol)
    assert got.dtype == dtype and counting.requested == [9, 2, 7]
    if dtype == torch.bfloat16 or pair_bookkeeping == "torch ops":  # fp32 with the C expert loop: auto takes the batched path
        moe_experts_auto = forms(pair_bookkeeping, dtype)["auto"]
        assert torch.equal(moe_experts_auto(x, idx, w, bank, ACTS[act]), got)  # auto takes this path for one token


def test_single_token_input_errors() -> None:
    bank = _bank(4, 8, 8, seed=1)
    with pytest.raises(ValueError, match="one token"):
        moe_experts_single_token(torch.randn(2, 8), torch.tensor([[0], [1]]), torch.ones(2, 1), bank, ACTS["silu"])
    with pytest.raises(ValueError, match=r"expert ids \[0, 4\], expected 0..3"):
        moe_experts_single_token(torch.randn(1, 8), torch.tensor([[0, 4]]), torch.ones(1, 2), bank, ACTS["silu"])


def test_batched_refuses_banks_without_stacked_weights(pair_bookkeeping: str) -> None:
    bank = CountingBank(_bank(4, 8, 8, seed=1))
    with pytest.raises(TypeError, match="DenseExpertBank"):
        forms(pair_bookkeeping)["batched"](torch.randn(2, 8), torch.tensor([[0, 1], [2, 3]]), torch.ones(2, 2), bank, ACTS["silu"])


@pytest.mark.parametrize("fn", [moe_experts_naive, moe_experts_grouped])
def test_bad_shapes_raise(fn: MoEExpertsFn) -> None:
    bank = _bank(4, 8, 6, seed=0)
    x = torch.randn(3, 8)
    idx = torch.tensor([[0, 1], [1, 2], [3, 0]])
    w = torch.ones(3, 2)
    act = ACTS["silu"]
    with pytest.raises(ValueError, match=r"x shape \(3, 1, 8\)"):
        fn(x.unsqueeze(1), idx, w, bank, act)
    with pytest.raises(ValueError, match="topk_idx shape"):
        fn(x, idx[:2], w[:2], bank, act)
    with pytest.raises(ValueError, match="topk_weight shape"):
        fn(x, idx, w[:, :1], bank, act)
    with pytest.raises(ValueError, match="integer dtype"):
        fn(x, idx.float(), w, bank, act)
    with pytest.raises(ValueError, match=r"expert ids span 0\.\.4, expected 0\.\.3"):
        fn(x, idx + (idx == 3).long(), w, bank, act)
    with pytest.raises(ValueError, match="expected 0..3"):
        fn(x, idx - 1, w, bank, act)
    with pytest.raises(ValueError, match=r"expert 0 weights .* input width 12"):
        fn(torch.randn(3, 12), idx, w, bank, act)


def test_router_bias_changes_selection_not_weights(route: RouterFn) -> None:
    # Two tokens, four experts; logits chosen directly through an identity router weight.
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, -0.5, 1.5, 0.0]])
    weight = torch.eye(4)
    s = torch.sigmoid(x)
    plain = route(x, weight, None, 2, True, 1.0)
    assert plain.topk_idx.tolist() == [[0, 1], [2, 0]]
    bias = torch.tensor([0.0, -1.0, 0.0, 1.0])
    out = route(x, weight, bias, 2, True, 1.0)
    assert out.topk_idx.dtype == torch.int64 and out.topk_weight.dtype == torch.float32
    assert out.topk_idx.tolist() == [[3, 0], [3, 2]]
    sel = s.gather(1, out.topk_idx)
    torch.testing.assert_close(out.topk_weight, sel / sel.sum(-1, keepdim=True))
    torch.testing.assert_close(out.scores, s)
    biased = (s + bias).gather(1, out.topk_idx)
    assert not torch.allclose(out.topk_weight, biased / biased.sum(-1, keepdim=True))


def test_router_scaling_and_no_renormalize(route: RouterFn) -> None:
    g = torch.Generator().manual_seed(0)
    x, weight, bias = torch.randn(7, 12, generator=g), torch.randn(9, 12, generator=g), 0.1 * torch.randn(9, generator=g)
    s = torch.sigmoid(x @ weight.t())
    renorm = route(x, weight, bias, 3, True, 2.446)
    torch.testing.assert_close(renorm.topk_weight.sum(-1), torch.full((7,), 2.446))
    raw = route(x, weight, bias, 3, False, 2.5)
    assert torch.equal(raw.topk_idx, renorm.topk_idx)
    torch.testing.assert_close(raw.topk_weight, s.gather(1, raw.topk_idx) * 2.5)
    assert torch.equal(raw.topk_idx, torch.topk(s + bias, 3, dim=-1).indices)


def test_router_bf16_input_scores_in_fp32(route: RouterFn) -> None:
    g = torch.Generator().manual_seed(1)
    x, weight = torch.randn(5, 16, generator=g), torch.randn(6, 16, generator=g)
    out = route(x.bfloat16(), weight.bfloat16(), None, 6, True, 1.0)
    assert out.scores.dtype == torch.float32
    torch.testing.assert_close(out.scores, torch.sigmoid(x.bfloat16().float() @ weight.bfloat16().float().t()))
    assert sorted(out.topk_idx[0].tolist()) == list(range(6))


def test_router_bad_arguments_raise(route: RouterFn) -> None:
    x, weight = torch.randn(3, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match="k=6, expected 1..5"):
        route(x, weight, None, 6, True, 1.0)
    with pytest.raises(ValueError, match="k=0"):
        route(x, weight, None, 0, True, 1.0)
    with pytest.raises(ValueError, match=r"bias shape \(4,\), expected \(5,\)"):
        route(x, weight, torch.zeros(4), 2, True, 1.0)
    with pytest.raises(ValueError, match="weight shape"):
        route(x, weight[:, :3], None, 2, True, 1.0)


def test_router_then_experts_end_to_end(route: RouterFn) -> None:
    g = torch.Generator().manual_seed(2)
    t, e, k, d = 50, 16, 4, 32
    x = torch.randn(t, d, generator=g)
    routed = route(x, torch.randn(e, d, generator=g), torch.randn(e, generator=g), k, True, 1.0)
    bank = _bank(e, d, 24, seed=3)
    want = moe_experts_naive(x, routed.topk_idx, routed.topk_weight, bank, ACTS["situ"])
    torch.testing.assert_close(moe_experts_grouped(x, routed.topk_idx, routed.topk_weight, bank, ACTS["situ"]), want, rtol=1e-5, atol=1e-5)
