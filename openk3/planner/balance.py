"""Load imbalance across expert-parallel ranks: the step waits for the busiest rank, not the mean.

Model: each rank hosts s = (E + redundant) / R expert slots. Expert popularity has a coefficient of variation cv_e
(systematic skew); a rank's load then varies with cv_sys = cv_e / sqrt(s), plus multinomial noise 1 / sqrt(m) for m
token-expert assignments per rank. The busiest of R ranks sits sqrt(2 ln R) deviations above the mean:
    max / mean = 1 + sqrt(cv_sys^2 + 1/m) * sqrt(2 ln R)
- none:   placement ignores load, cv_sys as above.
- eplb:   replication and packing remove the long-run skew; a residual fraction remains (drift between re-balances).
- moonep: every rank gets exactly s*K token slots (max/mean = 1); the price is pulling remote experts' weights to the
          ranks that absorb shed tokens.
Defaults fit TensorRT-LLM's DeepSeek-R1 figures on 32 GB200 (spec section 4): hottest rank 1.56 over the mean without
balancing, 0.11 with EPLB, at 288 slots / 32 ranks = 9 per rank and large batches (noise negligible):
    cv_e = 1.56 / sqrt(2 ln 32) * sqrt(9) = 1.78; residual = 0.11 / 1.56 = 0.07.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from openk3.checks import fail
from openk3.config import ModelConfig
from openk3.planner.inputs import Balance, Layout

_NORMAL_MEAN_EXCESS = 1 / math.sqrt(2 * math.pi)  # E[max(0, Z)] for Z ~ N(0, 1)


@dataclass(frozen=True)
class BalanceParams:
    expert_load_cv: float = 1.78
    eplb_residual: float = 0.07

    def __post_init__(self) -> None:
        if self.expert_load_cv < 0:
            fail("BalanceParams", "expert_load_cv", self.expert_load_cv, ">= 0")
        if not 0 <= self.eplb_residual <= 1:
            fail("BalanceParams", "eplb_residual", self.eplb_residual, "a fraction in [0, 1]")


def slots_per_rank(config: ModelConfig, layout: Layout) -> float:
    return (config.moe.num_experts + layout.redundant_experts) / layout.ep_size


def _rank_cv(config: ModelConfig, layout: Layout, assignments_per_rank: float, params: BalanceParams) -> float:
    cv_sys = params.expert_load_cv / math.sqrt(slots_per_rank(config, layout))
    if layout.balance == Balance.EPLB:
        cv_sys *= params.eplb_residual
    noise = 1 / assignments_per_rank if assignments_per_rank > 0 else 0.0
    return math.sqrt(cv_sys**2 + noise)


def rank_imbalance(config: ModelConfig, layout: Layout, assignments_per_rank: float, params: BalanceParams) -> float:
    """max / mean token-expert assignments over the EP ranks at one MoE layer."""
    ranks = layout.ep_size
    if ranks <= 1 or layout.balance == Balance.MOONEP or assignments_per_rank <= 0:
        return 1.0
    factor = 1 + _rank_cv(config, layout, assignments_per_rank, params) * math.sqrt(2 * math.log(ranks))
    return min(factor, float(ranks))


def moonep_prefetch_experts(config: ModelConfig, layout: Layout, assignments_per_rank: float, params: BalanceParams) -> float:
    """Remote experts a receiving rank pulls per layer under MoonEP: the tokens it absorbs, cut into segments of one hot
    expert's load, capped at E/R prefetch slots (spec section 3)."""
    ranks = layout.ep_size
    if ranks <= 1 or assignments_per_rank <= 0:
        return 0.0
    unbalanced = Layout(layout.num_accelerators, layout.tp, layout.ep, layout.redundant_experts, Balance.NONE)
    cv = _rank_cv(config, unbalanced, assignments_per_rank, params)
    absorbed = 2 * _NORMAL_MEAN_EXCESS * cv * assignments_per_rank  # half the ranks absorb what the other half shed
    segment = assignments_per_rank / slots_per_rank(config, layout) * (1 + params.expert_load_cv)
    cap = math.ceil(config.moe.num_experts / ranks)
    return min(float(cap), math.ceil(absorbed / segment)) if absorbed > 0 else 0.0
