"""Issue 37 item 2: the per-user SLO is checked on what a user sees -- decode steps stretched by the prefill the
workload brings -- in the headline and in every row; without a workload no prefill is implied; a disaggregated decode
pool is judged on its own steps."""

from __future__ import annotations

import re

import pytest

from openk3.config import k3
from openk3.planner.cli import main
from openk3.planner.hardware import load_catalogue
from openk3.planner.inputs import Workload
from openk3.planner.perf import Scenario
from openk3.planner.plan import Plan, PlanRequest, make_plan
from openk3.planner.report import render_text
from openk3.planner.search import SLO, SearchSpace
from openk3.planner.workload import RequestMix, decode_stretch, demand

CAT = load_catalogue()
GB300 = CAT.system("gb300-nvl72")
SLO20 = SLO(min_user_tok_s=20, max_ttft_s=10)
SPACE = SearchSpace(max_accelerators=72)


def _plan(mix: RequestMix | None) -> Plan:
    context = mix.decode_context if mix else 8704
    prompt = mix.ttft_prompt if mix else 8192
    return make_plan(PlanRequest(config=k3(), system=GB300, context=context, prompt=prompt, slo=SLO20, space=SPACE, requests=mix))


def test_the_stretch_is_the_share_of_time_decode_gets() -> None:
    # at capacity, a replica busy 3 s of prefill and 1 s of decode per request decodes a quarter of the time
    assert decode_stretch(3.0, 1.0, None) == pytest.approx(4.0)
    # half the capacity on one replica: prefill takes 3/8 of the time
    assert decode_stretch(3.0, 1.0, 0.125) == pytest.approx(1 / (1 - 0.375))
    assert decode_stretch(0.0, 1.0, None) == 1.0


def test_every_row_meets_the_slo_as_users_see_it() -> None:
    mix = RequestMix(((8192, 1024),))
    plan = _plan(mix)
    assert plan.choice is not None and plan.demand is not None
    # the headline's speed is the workload section's "each user sees", and it meets the SLO
    assert plan.choice.user_tok_s == pytest.approx(plan.demand.user_tok_s, rel=1e-9)
    assert plan.demand.user_tok_s >= 20 and plan.demand.decode_stretch > 1.5
    cands = plan.search.candidates
    assert any(c.stretch > 1 for c in cands)
    for c in cands[:: max(1, len(cands) // 40)]:  # a spread of rows, each checked against the workload's own accounting
        sc = Scenario(k3(), plan.request.quant, c.layout, Workload(mix.decode_context, c.concurrency, mix.ttft_prompt), GB300)
        seen = demand(sc, c.metrics, mix, c.long_prefill).user_tok_s
        assert c.user_tok_s == pytest.approx(seen, rel=1e-9), c.describe()
        assert c.meets_slo == (seen >= 20 and c.metrics.ttft_s <= 10), c.describe()


def test_text_headline_and_workload_lines_agree() -> None:
    text = render_text(_plan(RequestMix(((8192, 1024),))))
    headline = re.search(r"; ([\d.]+) tok/s per user with the workload's prefill interleaved \(([\d.]+) on decode steps alone\)", text)
    sees = re.search(r"each user sees ([\d.]+) tok/s", text)
    assert headline and sees and headline.group(1) == sees.group(1)
    assert float(sees.group(1)) >= 20 and float(headline.group(2)) > float(headline.group(1))
    rows = re.findall(r"^\d+ acc, .*?\s(\d+)\s+([\d.]+)\s+[\d.]+\s+[\d,]+\s+[\d.]+\*.*\sok$", text, flags=re.M)
    assert rows and all(float(speed) >= 20 for _, speed in rows)


def test_without_a_workload_no_prefill_is_implied() -> None:
    plan = _plan(None)
    assert plan.choice is not None and all(c.stretch == 1.0 for c in plan.search.candidates)
    assert "no workload given, so no prefill load is implied" in render_text(plan)


def test_the_issue_command(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--model", "k3", "--hardware", "gb300-nvl72", "--input", "8k", "--output", "1k", "--min-user-tok-s", "20", "--max-ttft", "10",
               "--max-accelerators", "72"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    sees = re.search(r"each user sees ([\d.]+) tok/s", out)
    assert sees and float(sees.group(1)) >= 20
