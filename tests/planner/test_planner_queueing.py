"""The queueing simulation (issue 37 item 6) against closed forms on tiny cases, and in the plan."""

from __future__ import annotations

import argparse
import json

import pytest

from openk3.planner.cli import build_request, register
from openk3.planner.plan import make_plan
from openk3.planner.queueing import Arrivals, Percentiles, QueueSpec, SLOPercentile, interpolated, simulate
from openk3.planner.report_json import render_json

D = 0.1  # service time of one 100-token prompt


def _md1(rate: float, arrivals: Arrivals = Arrivals.POISSON, seed: int = 1, n: int = 20000) -> Percentiles:
    """One request at a time, one output token, a chunk that holds the prompt: a single server with service D."""
    return simulate([(100, 1)], QueueSpec(rate, arrivals, requests=n, seed=seed), lambda dec, p: p * D / 100, max_batch=1, chunk=100).ttft


@pytest.mark.parametrize("rho", [0.3, 0.6, 0.8])
def test_mean_ttft_is_md1(rho: float) -> None:
    """Pollaczek-Khinchine for M/D/1: mean wait rho D / (2 (1 - rho)); TTFT = wait + D."""
    ttft = _md1(rho / D)
    assert ttft.mean == pytest.approx(D + rho * D / (2 * (1 - rho)), rel=0.06)


def test_md1_no_wait_fraction_and_median() -> None:
    """P(no wait) = 1 - rho: at rho 0.3 the median request starts at once (TTFT = D exactly); at rho 0.6 it waits."""
    assert _md1(3.0).p50 == pytest.approx(D)
    assert _md1(6.0).p50 > D


def test_bursty_arrivals_wait_as_kingman_bounds() -> None:
    """Gamma gaps with ca^2 = 4 at rho 0.6: the mean wait sits above Kingman's heavy-traffic approximation
    rho / (1 - rho) x (ca^2 + cs^2) / 2 x D (cs = 0: deterministic service) and below his upper bound
    lambda (var_a + var_s) / (2 (1 - rho)); Poisson gaps (ca^2 = 1) wait much less at the same rate."""
    rho, rate, ca2 = 0.6, 6.0, 4.0
    poisson, bursty = _md1(rate), _md1(rate, Arrivals.BURSTY)
    approx = rho / (1 - rho) * ca2 / 2 * D
    bound = rate * (ca2 / rate**2) / (2 * (1 - rho))
    assert approx <= bursty.mean - D <= bound
    assert bursty.mean - D > 3 * (poisson.mean - D) and bursty.p99 > poisson.p99


def test_deterministic_for_a_seed() -> None:
    assert _md1(6.0, seed=3, n=500) == _md1(6.0, seed=3, n=500)
    assert _md1(6.0, seed=3, n=500) != _md1(6.0, seed=4, n=500)


def test_light_load_tpot_is_the_decode_step_and_batching_shares_it() -> None:
    step = interpolated([(1, 0.01), (8, 0.02)])
    light = simulate([(10, 50)], QueueSpec(0.01, requests=20), lambda dec, p: (step(dec) if dec else 0) + p * 1e-4, 8, 64)
    assert light.tpot is not None and light.tpot.p50 == pytest.approx(0.01)
    heavy = simulate([(10, 50)], QueueSpec(50.0, requests=200), lambda dec, p: (step(dec) if dec else 0) + p * 1e-4, 8, 64)
    assert heavy.tpot is not None and 0.01 < heavy.tpot.p50 and heavy.max_queue > 0


def test_slo_percentile() -> None:
    stats = simulate([(100, 1)], QueueSpec(6.0, requests=5000), lambda dec, p: p * D / 100, 1, 100)
    assert SLOPercentile.of(stats, max_ttft_s=10, min_user_tok_s=0).percentile == "p99"
    assert SLOPercentile.of(stats, max_ttft_s=stats.ttft.p90, min_user_tok_s=0).percentile == "p90"
    assert SLOPercentile.of(stats, max_ttft_s=D / 2, min_user_tok_s=0).percentile is None


def test_plan_with_rate_reports_queueing() -> None:
    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    args = ["plan", "--model", "k3", "--hardware", "gb300-nvl72", "--accelerators", "72", "--input", "8k", "--output", "1k", "--rate", "5",
            "--max-ttft", "10", "--sim-requests", "300", "--arrivals", "bursty"]  # fmt: skip
    plan = make_plan(build_request(p.parse_args(args)))
    assert plan.queue is not None
    stats, met = plan.queue
    assert stats.spec.arrivals == Arrivals.BURSTY and stats.spec.requests == 300
    doc = json.loads(json.dumps(render_json(plan), allow_nan=False))
    assert doc["queueing"]["slo_met_at"] == met.percentile and doc["queueing"]["ttft_s"]["p99"] == stats.ttft.p99


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--seed", "3"], "--seed needs --rate"),
        (["--input", "8k", "--output", "1k", "--rate", "2", "--burstiness", "3"], "--burstiness needs --arrivals bursty"),
        (["--spec-draft-layers", "2"], "--spec-draft-layers needs --spec-tokens"),
        (["--tool-wait", "drop", "--prefix-hit", "0.5"], "--prefix-hit, --tool-wait need --agent-turns"),
    ],
)
def test_flags_without_their_feature_are_errors(extra: list[str], message: str) -> None:
    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    with pytest.raises(ValueError, match=message):
        build_request(p.parse_args(["plan", "--model", "k3", "--hardware", "gb300-nvl72", *extra]))
