"""The headline plan is true (issue 20, defects 1 and 2): it fits, it meets every constraint, or no plan is reported.

A plan that does not fit or misses the SLO is never printed with speed and cost; the CLI says why and exits 1.
"""

from __future__ import annotations

import pytest

from openk3.config import k3
from openk3.planner import SLO, PlanRequest, SearchSpace, load_catalogue, make_plan
from openk3.planner.cli import main

CAT = load_catalogue()
GB300, H200 = CAT.system("gb300-nvl72"), CAT.system("hgx-h200")
FAST = ["--max-accelerators", "72"]


def test_layout_that_does_not_fit_is_not_a_plan(capsys: pytest.CaptureFixture[str]) -> None:
    # issue 20: H200 x8 at 32k needs 295.7 GB per GPU (DP attention) against 126.9 GB usable, yet was printed with a speed
    rc = main(["plan", "--model", "k3", "--hardware", "hgx-h200", "--context", "32k", "--accelerators", "8", "--tp", "1", *FAST])
    cap = capsys.readouterr()
    assert rc == 1
    text = cap.out + cap.err
    assert "does not fit" in text and "295.7 GB" in text and "126.9 GB" in text
    assert "decode step" not in cap.out and "per 1M output tokens" not in cap.out
    # without --tp every TP that divides the heads is tried; none fits 8 H200s, and the reason is the closest one
    rc = main(["plan", "--model", "k3", "--hardware", "hgx-h200", "--context", "32k", "--accelerators", "8", *FAST])
    cap = capsys.readouterr()
    assert rc == 1 and "TP8" in cap.out + cap.err and "decode step" not in cap.out


def test_make_plan_without_a_fitting_layout_has_no_metrics() -> None:
    plan = make_plan(PlanRequest(config=k3(), system=H200, context=32768, accelerators=8, tp=1, space=SearchSpace(max_accelerators=72)))
    assert plan.metrics is None and plan.problem is not None
    assert plan.memory is not None and not plan.memory.fits  # the breakdown that says why is still there
    assert plan.tiers == () and plan.break_even == {}


def test_requested_concurrency_that_does_not_fit_is_refused() -> None:
    plan = make_plan(PlanRequest(config=k3(), system=GB300, context=32768, accelerators=72, tp=1, concurrency=100_000, space=SearchSpace(max_accelerators=72)))
    assert plan.metrics is None and plan.problem is not None and "100,000 sequences" in plan.problem


def test_headline_meets_the_slo_and_is_the_searchs_best() -> None:
    # issue 20: GB300 at 8k with >= 20 tok/s/user printed a 14.2 tok/s/user headline while the search's best met the SLO
    slo = SLO(min_user_tok_s=20)
    plan = make_plan(PlanRequest(config=k3(), system=GB300, context=8192, slo=slo, space=SearchSpace(max_accelerators=72)))
    assert plan.problem is None and plan.metrics is not None and plan.choice is not None
    assert plan.metrics.per_user_tok_s >= 20
    best = plan.search.best
    assert best is not None and plan.metrics.usd_per_m_output == pytest.approx(best.metrics.usd_per_m_output)


def test_headline_with_pinned_size_meets_the_slo() -> None:
    slo = SLO(min_user_tok_s=20, max_ttft_s=10)
    plan = make_plan(PlanRequest(config=k3(), system=GB300, context=8192, accelerators=72, slo=slo, space=SearchSpace(max_accelerators=72)))
    assert plan.metrics is not None and plan.layout is not None
    assert plan.layout.num_accelerators == 72
    assert plan.metrics.per_user_tok_s >= 20 and plan.metrics.ttft_s <= 10


def test_slo_nobody_meets_is_said_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--model", "k3", "--hardware", "gb300-nvl72", "--context", "8k", "--min-user-tok-s", "1000", *FAST])
    cap = capsys.readouterr()
    assert rc == 1
    assert "no layout meets the SLO" in cap.out + cap.err and "fastest" in cap.out + cap.err
    assert "per 1M output tokens" not in cap.out
