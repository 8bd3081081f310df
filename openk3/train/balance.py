"""Router load balancing by the selection bias: Quantile Balancing (K3), the DeepSeek-V3 sign update, or none.

Legend: m tokens of a micro-batch, n experts, k experts per token, q = m k / n the balanced load per expert.
beta [n] is the price of each expert; routing picks the top-k of S - beta per token. The model stores the bias with the
opposite sign (`e_score_correction_bias` = -beta, selection on S + bias), so the balancer reads and writes -beta.

Quantile Balancing (spec/model.md section 5): routing a batch is the transportation LP
  max sum S_ij x_ij  s.t. sum_j x_ij = k, sum_i x_ij = q, 0 <= x <= 1,
whose dual has a price alpha_i per token and beta_j per expert. One QB iteration is exact block-coordinate minimisation of
the dual: alpha_i = the (k+1)-th largest of S_ij - beta_j (given beta), then beta_j = the (q+1)-th largest over tokens of
S_ij - alpha_i (given alpha), after which exactly q tokens of column j have S_ij - alpha_i > beta_j. At a fixed point every row
has k and every column q positive reduced costs, so the top-k routing is balanced and, by complementary slackness, optimal.
A fractional q takes the quantile between its two neighbours (linear interpolation).

Plain block-coordinate descent on this piecewise-linear dual can stop at a corner that is not the optimum (no single block
improves, a joint move would); on small random matrices it typically ends a few tokens off balance. The `temperature`
variant replaces each hard quantile by the smoothed one of the entropy-regularised dual (solve sum sigmoid((x - t) / tau) =
count; the hard quantile is its tau -> 0 limit), whose block descent cannot stall, and anneals tau geometrically from
`temperature` to `final_temperature` over the iterations: with tau well below the score gaps the top-k routing it yields is
the LP optimum (tested against scipy's LP solver).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from openk3.checks import fail


class BalanceMethod(enum.Enum):
    QUANTILE = "qb"
    SIGN = "sign"
    NONE = "none"


class Pooling(enum.Enum):
    AVERAGE = "average"  # each micro-batch solves its own beta; the betas are averaged
    HISTOGRAM = "histogram"  # per-expert histograms of S - alpha are summed over micro-batches; beta is the pooled quantile


@dataclass(frozen=True)
class BalanceConfig:
    method: BalanceMethod = BalanceMethod.QUANTILE
    pooling: Pooling = Pooling.AVERAGE
    iterations: int = 1  # alternating alpha/beta rounds per step
    ema: float = 0.0  # beta <- ema * beta_old + (1 - ema) * beta_new
    recenter: bool = True  # subtract the mean price (top-k is invariant to a common shift; keeps the bias near zero)
    sign_rate: float = 1e-3  # DeepSeek-V3's bias update speed u
    histogram_bins: int = 2048
    temperature: float = 0.0  # 0: the hard quantiles of the spec; > 0: smoothed quantiles, annealed to final_temperature
    final_temperature: float = 1e-6
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.iterations < 1:
            fail("BalanceConfig", "iterations", self.iterations, ">= 1")
        if not 0.0 <= self.ema < 1.0:
            fail("BalanceConfig", "ema", self.ema, "0 <= ema < 1")
        if self.sign_rate <= 0:
            fail("BalanceConfig", "sign_rate", self.sign_rate, "> 0")
        if self.temperature < 0 or self.final_temperature <= 0:
            raise ValueError(f"BalanceConfig.temperature={self.temperature}, final_temperature={self.final_temperature}: expected >= 0 and > 0")
        if self.histogram_bins < 2:
            fail("BalanceConfig", "histogram_bins", self.histogram_bins, ">= 2")


def kth_largest(x: torch.Tensor, rank: float, dim: int) -> torch.Tensor:
    """The `rank`-th largest (1-based) along dim; a fractional rank interpolates between its two integer neighbours."""
    size = x.shape[dim]
    if not 1 <= rank <= size:
        raise ValueError(f"kth_largest: rank={rank} is invalid for a dimension of size {size}")
    lo = int(rank)
    hi = min(lo + 1, size)
    top = torch.topk(x, hi, dim=dim).values
    v_lo = top.select(dim, lo - 1)
    frac = rank - lo
    return v_lo if frac == 0 else v_lo + frac * (top.select(dim, hi - 1) - v_lo)


def soft_threshold(x: torch.Tensor, count: float, tau: float, dim: int, rounds: int = 64) -> torch.Tensor:
    """t with sum over dim of sigmoid((x - t) / tau) = count (bisection; the sum falls monotonically in t). As tau -> 0, t
    tends to a point between the count-th and (count+1)-th largest: the hard threshold."""
    lo = x.amin(dim, keepdim=True) - 40 * tau
    hi = x.amax(dim, keepdim=True) + 40 * tau
    for _ in range(rounds):
        mid = (lo + hi) / 2
        above = torch.sigmoid((x - mid) / tau).sum(dim, keepdim=True) > count
        lo, hi = torch.where(above, mid, lo), torch.where(above, hi, mid)
    return ((lo + hi) / 2).squeeze(dim)


def token_prices(S_mn: torch.Tensor, beta_n: torch.Tensor, k: int, tau: float = 0.0) -> torch.Tensor:
    """alpha [m]: the (k+1)-th largest of S_ij - beta_j per token (step 1); smoothed when tau > 0."""
    if tau > 0:
        return soft_threshold(S_mn - beta_n, k, tau, dim=1)
    return kth_largest(S_mn - beta_n, k + 1, dim=1)


def expert_prices(S_mn: torch.Tensor, alpha_m: torch.Tensor, k: int, tau: float = 0.0) -> torch.Tensor:
    """beta [n]: the (q+1)-th largest over tokens of S_ij - alpha_i per expert, q = m k / n (step 2); smoothed when tau > 0."""
    m, n = S_mn.shape
    if tau > 0:
        return soft_threshold(S_mn - alpha_m[:, None], m * k / n, tau, dim=0)
    return kth_largest(S_mn - alpha_m[:, None], m * k / n + 1, dim=0)


def dual_objective(S_mn: torch.Tensor, alpha_m: torch.Tensor, beta_n: torch.Tensor, k: int) -> float:
    """The LP dual k sum alpha + q sum beta + sum (S - alpha - beta)+: an upper bound on every feasible routing's score."""
    m, n = S_mn.shape
    return float(k * alpha_m.sum() + (m * k / n) * beta_n.sum() + (S_mn - alpha_m[:, None] - beta_n).clamp(min=0).sum())


def pooled_expert_prices(S_list: list[torch.Tensor], alpha_list: list[torch.Tensor], k: int, bins: int) -> torch.Tensor:
    """beta [n] from per-expert histograms of S - alpha summed over micro-batches (what ranks would all-reduce), with the
    quantile interpolated inside its bin."""
    diffs = [S - a[:, None] for S, a in zip(S_list, alpha_list, strict=True)]
    lo = min(float(d.min()) for d in diffs)
    hi = max(float(d.max()) for d in diffs)
    hi = hi if hi > lo else lo + 1.0
    n = diffs[0].shape[1]
    width = (hi - lo) / bins
    counts = torch.zeros(n, bins, dtype=torch.float64)
    for d in diffs:
        b = ((d - lo) / width).floor().clamp_(0, bins - 1).long()
        counts.scatter_add_(1, b.t(), torch.ones_like(b.t(), dtype=torch.float64))
    m_total = sum(d.shape[0] for d in diffs)
    q = m_total * k / n
    above = counts.flip(1).cumsum(1).flip(1)  # tokens in this bin or higher, [n, bins]
    # the quantile sits in the highest bin whose "this or higher" count exceeds q
    idx = (above > q).sum(1).clamp(min=1) - 1
    in_bin = counts.gather(1, idx[:, None]).squeeze(1)
    higher = above.gather(1, idx[:, None]).squeeze(1) - in_bin
    frac = ((q - higher) / in_bin.clamp(min=1)).clamp(0, 1)
    edge_hi = lo + (idx.double() + 1) * width
    return (edge_hi - frac * width).to(S_list[0].dtype)


def quantile_balance(S_list: list[torch.Tensor], beta_n: torch.Tensor, k: int, config: BalanceConfig) -> torch.Tensor:
    """New expert prices from the micro-batches' scores S [m, n] and the prices they were routed with."""
    S_list = [S.to(config.dtype) for S in S_list]
    beta = beta_n.to(config.dtype)
    for it in range(config.iterations):
        tau = 0.0
        if config.temperature > 0:
            ratio = config.final_temperature / config.temperature
            tau = config.temperature * ratio ** (it / max(1, config.iterations - 1))
        alphas = [token_prices(S, beta, k, tau) for S in S_list]
        if config.pooling == Pooling.HISTOGRAM and len(S_list) > 1:
            beta = pooled_expert_prices(S_list, alphas, k, config.histogram_bins)
        else:
            beta = torch.stack([expert_prices(S, a, k, tau) for S, a in zip(S_list, alphas, strict=True)]).mean(0)
    return beta


def expert_load(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens per expert [n] (float)."""
    return torch.bincount(topk_idx.reshape(-1), minlength=num_experts).float()


def max_over_mean(load_n: torch.Tensor) -> float:
    """max/mean expert load: 1.0 is perfectly balanced, n/k means one expert took every slot."""
    return float(load_n.max() / load_n.mean().clamp(min=1e-12))


def route_topk(S_mn: torch.Tensor, beta_n: torch.Tensor, k: int) -> torch.Tensor:
    """The deployment rule: frozen prices, plain top-k of S - beta, [m, k]."""
    return torch.topk(S_mn - beta_n, k, dim=1).indices


class RouterBalancer:
    """Collects each MoE layer's router scores and choices during a step, then moves every layer's selection bias.

    Contract: `observe` is called by the trainer's recording backend during forward (no grad); `step` is called once after
    the optimizer step and writes `layer.gate.e_score_correction_bias` in place; `load_stats` reports the loads the step's
    routing actually produced (before the update)."""

    def __init__(self, config: BalanceConfig, top_k: int) -> None:
        self.config, self.top_k = config, top_k
        self.scores: dict[int, list[torch.Tensor]] = {}
        self.loads: dict[int, torch.Tensor] = {}

    def observe(self, layer_index: int, scores_TE: torch.Tensor, topk_idx: torch.Tensor) -> None:
        self.scores.setdefault(layer_index, []).append(scores_TE.detach().float())
        load = expert_load(topk_idx.detach(), scores_TE.shape[1])
        self.loads[layer_index] = self.loads.get(layer_index, torch.zeros_like(load)) + load

    def load_stats(self) -> dict[int, float]:
        """max/mean load per layer over everything observed since the last step."""
        return {i: max_over_mean(load) for i, load in sorted(self.loads.items())}

    @torch.no_grad()
    def step(self, moe_layers: list) -> dict[int, float]:
        stats = self.load_stats()
        for layer in moe_layers:
            scores = self.scores.get(layer.layer_index)
            if not scores or self.config.method == BalanceMethod.NONE:
                continue
            bias = layer.gate.e_score_correction_bias
            if self.config.method == BalanceMethod.QUANTILE:
                beta_old = -bias.to(self.config.dtype)
                beta = quantile_balance(scores, beta_old, self.top_k, self.config)
                beta = self.config.ema * beta_old + (1.0 - self.config.ema) * beta
                new_bias = -beta
            else:
                load = self.loads[layer.layer_index]
                new_bias = bias.to(self.config.dtype) + self.config.sign_rate * torch.sign(load.mean() - load).to(self.config.dtype)
            if self.config.recenter:
                new_bias = new_bias - new_bias.mean()
            bias.copy_(new_bias.to(bias.dtype))
        self.scores.clear()
        self.loads.clear()
        return stats
