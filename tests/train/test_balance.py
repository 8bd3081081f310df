"""Quantile Balancing against the routing LP (scipy's solver as the oracle), and the sign-update baseline."""

from __future__ import annotations

import pytest
import torch

from openk3.train.balance import (
    BalanceConfig,
    BalanceMethod,
    Pooling,
    RouterBalancer,
    dual_objective,
    expert_load,
    expert_prices,
    kth_largest,
    max_over_mean,
    quantile_balance,
    route_topk,
    token_prices,
)


def lp_optimum(S: torch.Tensor, k: int) -> tuple[float, torch.Tensor]:
    """max sum S x s.t. rows sum to k, columns to m k / n, 0 <= x <= 1 (the batch routing LP)."""
    linprog = pytest.importorskip("scipy.optimize").linprog
    import numpy as np

    m, n = S.shape
    q = m * k // n
    rows = np.kron(np.eye(m), np.ones((1, n)))
    cols = np.kron(np.ones((1, m)), np.eye(n))
    res = linprog(-S.numpy().ravel(), A_eq=np.vstack([rows, cols]), b_eq=[k] * m + [q] * n, bounds=(0, 1), method="highs")
    assert res.status == 0
    return -res.fun, torch.from_numpy(res.x.reshape(m, n))


def random_scores(seed: int, m: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # a per-expert offset makes the unbalanced routing skewed, as a real router's is
    return torch.sigmoid(torch.randn(m, n, generator=g, dtype=torch.float64) * 2 + torch.randn(n, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("seed,m,n,k", [(0, 24, 8, 2), (1, 32, 8, 3), (2, 16, 4, 1), (3, 30, 6, 2)])
def test_annealed_qb_reaches_the_lp_optimum_with_exact_balance(seed, m, n, k):
    S = random_scores(seed, m, n)
    optimum, x = lp_optimum(S, k)
    assert torch.allclose(x, x.round(), atol=1e-6), "the LP optimum is integral (transportation problem), so exact balance exists"
    beta0 = torch.zeros(n, dtype=torch.float64)
    before = expert_load(route_topk(S, beta0, k), n)
    cfg = BalanceConfig(iterations=80, temperature=0.05, final_temperature=1e-6, dtype=torch.float64)
    beta = quantile_balance([S], beta0, k, cfg)
    idx = route_topk(S, beta, k)
    load = expert_load(idx, n)
    print(f"m={m} n={n} k={k}: max/mean load {max_over_mean(before):.3f} -> {max_over_mean(load):.3f}")
    assert max_over_mean(before) > 1.0
    assert torch.equal(load, torch.full((n,), m * k / n, dtype=load.dtype))
    assert S.gather(1, idx).sum().item() == pytest.approx(optimum, abs=1e-9)
    routed = torch.zeros_like(S).scatter_(1, idx, 1.0)
    assert torch.equal(routed, x.round())


def test_hard_qb_step_is_exact_block_minimisation_and_bounds_the_lp():
    S = random_scores(4, 24, 8)
    k, (m, n) = 2, S.shape
    optimum, _ = lp_optimum(S, k)
    beta = torch.zeros(n, dtype=torch.float64)
    previous = float("inf")
    for _ in range(5):
        alpha = token_prices(S, beta, k)
        beta = expert_prices(S, alpha, k)
        # beta_j is the (q+1)-th largest of its column: at most q tokens clear it strictly, at least q + 1 reach it (the
        # (k+1)-th entries of the rows sit exactly on the old price, so ties are structural)
        reduced = S - alpha[:, None]
        assert bool(((reduced > beta).sum(0) <= m * k // n).all()) and bool(((reduced >= beta).sum(0) >= m * k // n + 1).all())
        d = dual_objective(S, alpha, beta, k)
        assert optimum - 1e-9 <= d <= previous + 1e-12  # weak duality; coordinate descent never goes up
        previous = d
    cfg = BalanceConfig(iterations=5, dtype=torch.float64)
    before = max_over_mean(expert_load(route_topk(S, torch.zeros(n, dtype=torch.float64), k), n))
    after = max_over_mean(expert_load(route_topk(S, quantile_balance([S], torch.zeros(n, dtype=torch.float64), k, cfg), k), n))
    assert after < before


def test_pooling_histogram_matches_one_big_batch_and_average_is_close():
    S = random_scores(5, 256, 8)
    parts = list(S.split(64))
    k, beta0 = 2, torch.zeros(8, dtype=torch.float64)
    whole = quantile_balance([S], beta0, k, BalanceConfig(dtype=torch.float64))
    hist = quantile_balance(parts, beta0, k, BalanceConfig(pooling=Pooling.HISTOGRAM, histogram_bins=1 << 16, dtype=torch.float64))
    avg = quantile_balance(parts, beta0, k, BalanceConfig(pooling=Pooling.AVERAGE, dtype=torch.float64))
    assert torch.allclose(hist, whole, atol=1e-3)
    assert torch.allclose(avg, whole, atol=0.1)


def test_kth_largest_interpolates_fractional_ranks():
    x = torch.tensor([[5.0, 1.0, 3.0, 4.0]])
    assert kth_largest(x, 2, dim=1).item() == 4.0
    assert kth_largest(x, 2.5, dim=1).item() == 3.5
    with pytest.raises(ValueError, match="rank=5"):
        kth_largest(x, 5, dim=1)


class _Gate:
    def __init__(self, n: int) -> None:
        self.e_score_correction_bias = torch.zeros(n)


class _Layer:
    def __init__(self, index: int, n: int) -> None:
        self.layer_index, self.gate = index, _Gate(n)


@pytest.mark.parametrize("method", [BalanceMethod.QUANTILE, BalanceMethod.SIGN])
def test_balancer_moves_loads_toward_balance_on_a_fixed_router(method):
    """A fixed skewed router over steps: the bias must bring max/mean load down; 'none' leaves the bias alone."""
    torch.manual_seed(0)
    n, k, layer = 8, 2, _Layer(3, 8)
    cfg = BalanceConfig(method=method, sign_rate=0.02)
    balancer = RouterBalancer(cfg, k)
    history = []
    for _ in range(60):
        S = torch.sigmoid(torch.randn(512, n) + torch.linspace(-1.5, 1.5, n))
        idx = torch.topk(S + layer.gate.e_score_correction_bias, k, dim=1).indices
        balancer.observe(3, S, idx)
        history.append(balancer.step([layer])[3])
    first, last = history[0], sum(history[-10:]) / 10
    print(f"{method.value}: max/mean load {first:.3f} -> {last:.3f} (mean of the last 10 steps)")
    assert first > 1.5 and last < 1.25
    assert abs(float(layer.gate.e_score_correction_bias.mean())) < 1e-6  # re-centred

    none = RouterBalancer(BalanceConfig(method=BalanceMethod.NONE), k)
    other = _Layer(3, 8)
    none.observe(3, S, idx)
    none.step([other])
    assert torch.equal(other.gate.e_score_correction_bias, torch.zeros(n))


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="iterations=0"):
        BalanceConfig(iterations=0)
    with pytest.raises(ValueError, match="ema=1.0"):
        BalanceConfig(ema=1.0)
