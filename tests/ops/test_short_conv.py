"""Short conv: fast == per-token reference, prefill + decode == one-shot, packing, short sequences, transformers' fallbacks."""

from __future__ import annotations

import pytest
import torch

from openk3.ops.registry import op
from openk3.ops.short_conv import causal_conv1d_update, causal_conv1d_update_, fast, naive

C = 6


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("W", [1, 2, 4])
@pytest.mark.parametrize("T", [0, 1, 2, 5, 17])
def test_fast_matches_naive(T: int, W: int, with_state: bool, activation: str | None) -> None:
    x, w = rand(2, T, C, seed=T), rand(C, 1, W, seed=W)
    state = rand(2, C, W - 1, seed=99) if with_state else None
    y_ref, s_ref = naive.causal_conv1d(x, w, state, activation=activation)
    y, s = fast.causal_conv1d(x, w, state, activation=activation)
    assert y.shape == (2, T, C) and s.shape == (2, C, W - 1)
    assert max_err(y, y_ref) < 1e-5 and torch.equal(s, s_ref)


def test_reference_formula_and_state_convention() -> None:
    """y_t = silu(sum_w weight[:, w] * window[:, w]), window oldest first, weight[:, -1] on the current token."""
    x, w, s0 = rand(1, 3, C), rand(C, 4, seed=1), rand(1, C, 3, seed=2)
    y, s = naive.causal_conv1d(x, w, s0)
    history = torch.cat((s0[0], x[0].t()), dim=1)  # [C, 3 + T]
    for t in range(3):
        expected = torch.nn.functional.silu((history[:, t : t + 4] * w).sum(1))
        assert max_err(y[0, t], expected) < 1e-6
    assert torch.equal(s[0], history[:, -3:])


@pytest.mark.parametrize("impl", ["naive", "fast"])
def test_prefill_then_decode_equals_one_shot(impl: str) -> None:
    conv = op("short_conv", impl)
    x, w, s0 = rand(3, 12, C), rand(C, 4, seed=1), rand(3, C, 3, seed=2)
    y_all, s_all = conv(x, w, s0)
    y_pre, s = conv(x[:, :5], w, s0)
    ys = [y_pre]
    for t in range(5, 12):
        before = s.clone()
        y_t, s_new = causal_conv1d_update(x[:, t], w, s)
        assert torch.equal(s, before), "causal_conv1d_update must not write its input state"
        ys.append(y_t[:, None])
        s = s_new
    assert max_err(torch.cat(ys, dim=1), y_all) < 1e-5 and torch.equal(s, s_all)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_in_place_update_equals_the_reference_update(state_dtype: torch.dtype) -> None:
    """causal_conv1d_update_ gives causal_conv1d_update's output and leaves its new window in the state it was given, also
    when that state is a slice of a larger pool."""
    x, w = rand(3, 5, C), rand(C, 1, 4, seed=1)  # the checkpoint's [C, 1, W] kernel
    pool = rand(6, C, 3, seed=2).to(state_dtype)
    s_ref = pool[2:5].clone()
    for t in range(5):
        y_ref, s_ref = causal_conv1d_update(x[:, t], w, s_ref)
        y = causal_conv1d_update_(x[:, t], w, pool[2:5])
        assert torch.equal(y, y_ref) and torch.equal(pool[2:5], s_ref)
    with pytest.raises(ValueError, match="state must be"):
        causal_conv1d_update_(x[:, 0], w, pool[:2])


@pytest.mark.parametrize("impl", ["naive", "fast"])
def test_sequence_shorter_than_window_keeps_old_state(impl: str) -> None:
    x, w, s0 = rand(2, 2, C), rand(C, 4, seed=1), rand(2, C, 3, seed=2)
    _, s = op("short_conv", impl)(x, w, s0)
    assert torch.equal(s, torch.cat((s0[:, :, 2:], x.transpose(1, 2)), dim=2))
    _, s_fresh = op("short_conv", impl)(x[:, :1], w)
    assert torch.equal(s_fresh[:, :, :2], torch.zeros(2, C, 2)) and torch.equal(s_fresh[:, :, 2], x[:, 0])


@pytest.mark.parametrize("impl", ["naive", "fast"])
def test_cu_seqlens_equals_separate_runs(impl: str) -> None:
    lengths = [2, 0, 7, 1]
    xs = [rand(1, n, C, seed=10 + i) for i, n in enumerate(lengths)]
    s0 = rand(4, C, 3, seed=3)
    w = rand(C, 4, seed=1)
    cu = torch.tensor([0, 2, 2, 9, 10], dtype=torch.int64)
    y, s = op("short_conv", impl)(torch.cat(xs, dim=1), w, s0, cu_seqlens=cu)
    for n, x_n in enumerate(xs):
        y_n, s_n = naive.causal_conv1d(x_n, w, s0[n : n + 1])
        assert y[:, cu[n] : cu[n + 1]].shape == y_n.shape
        if lengths[n]:
            assert max_err(y[:, cu[n] : cu[n + 1]], y_n) < 1e-5
        assert torch.equal(s[n], s_n[0])


def test_bf16_input_keeps_dtypes() -> None:
    x, w, s0 = rand(1, 9, C).to(torch.bfloat16), rand(C, 4, seed=1), rand(1, C, 3, seed=2)
    y, s = fast.causal_conv1d(x, w, s0)
    y_ref, _ = naive.causal_conv1d(x.float(), w, s0)
    assert y.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert max_err(y, y_ref) < 2e-2
    _, s16 = fast.causal_conv1d(x, w)
    assert s16.dtype == torch.bfloat16 and torch.equal(s16[0], x[0, -3:].t())


def test_dispatch_and_errors() -> None:
    assert op("short_conv", "naive") is naive.causal_conv1d
    assert op("short_conv", "fast") is fast.causal_conv1d and op("short_conv", "auto") is fast.causal_conv1d
    with pytest.raises(ValueError, match="fast.*naive.*auto"):
        op("short_conv", "cuda")
    x, w = rand(1, 4, C), rand(C, 4)
    with pytest.raises(ValueError, match="activation"):
        fast.causal_conv1d(x, w, activation="gelu")
    with pytest.raises(ValueError, match="weight"):
        fast.causal_conv1d(x, rand(C + 1, 4))
    with pytest.raises(ValueError, match="initial_state"):
        fast.causal_conv1d(x, w, rand(1, C, 4))
    with pytest.raises(ValueError, match="state"):
        causal_conv1d_update(x[:, 0], w, rand(1, C, 2))


def test_transformers_fallbacks_agree() -> None:
    """transformers' fallbacks are channels-first: x [B, C, T] (ours [B, T, C]), weight [C, W] (squeezed conv1d weight);
    causal_conv1d_fn starts from zeros and returns no state; causal_conv1d_update writes conv_state [B, C, S] in place (ours returns a
    new one) and, with S = W-1, keeps exactly our state: the last W-1 pre-conv inputs, oldest first."""
    kl = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear", reason="transformers with kimi_linear (>=5.24) is the peer oracle")
    x, w, s0 = rand(2, 9, C), rand(C, 4, seed=1), rand(2, C, 3, seed=2)
    theirs = kl.causal_conv1d_fn(x.transpose(1, 2), w, activation="silu").transpose(1, 2)
    ours, _ = fast.causal_conv1d(x, w)
    assert max_err(ours, theirs) < 1e-5
    for length in (1, 4):
        conv_state = s0.clone()
        theirs = kl.causal_conv1d_update(x[:, :length].transpose(1, 2), conv_state, w, activation="silu").transpose(1, 2)
        ours, s = fast.causal_conv1d(x[:, :length], w, s0)
        assert max_err(ours, theirs) < 1e-5 and torch.equal(s, conv_state)
    conv_state = s0.clone()
    theirs = kl.causal_conv1d_update(x[:, :1].transpose(1, 2), conv_state, w, activation="silu")[:, :, 0]
    ours, s = causal_conv1d_update(x[:, 0], w, s0)
    assert max_err(ours, theirs) < 1e-5 and torch.equal(s, conv_state)
