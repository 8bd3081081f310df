"""Fleets for a rate (`fleet.py`): the rate one replica serves within the SLO, and a remainder replica of a smaller
layout where that costs fewer accelerators than one more replica of the first."""

from __future__ import annotations

import functools
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from openk3.planner.cli import main
from openk3.planner.dtypes import with_dtypes
from openk3.planner.fleet import best_fleet, homogeneous, slo_rate
from openk3.planner.hardware import load_catalogue
from openk3.planner.inputs import Layout, Quantisation
from openk3.planner.models import qwen3_235b
from openk3.planner.search import SLO, Candidate, SearchSpace, search
from openk3.planner.workload import RequestMix
from tests.planner import hf_configs as hf


@functools.cache
def _priced() -> Candidate:
    """One candidate the search priced (a workload's busy seconds included); the tests set its figures."""
    mix = RequestMix(((4096, 1024),), rate=1.0)
    quant = with_dtypes(Quantisation.named("fp8"), kv="fp8")
    space = SearchSpace(sizes=(8,), tps=(1,), redundancy=False)
    result = search(qwen3_235b(), quant, load_catalogue().system("hgx-h200"), mix.decode_context, None, mix.ttft_prompt, space, concurrency=64, mix=mix)
    return result.candidates[0]


def _candidate(accelerators: int, per_user: float, busy_s: float, prefill_busy_s: float, ttft_s: float = 0.1) -> Candidate:
    c = _priced()
    return replace(
        c,
        layout=Layout(accelerators, tp=1),
        metrics=replace(c.metrics, per_user_tok_s=per_user, ttft_s=ttft_s),
        busy_s=busy_s,
        prefill_busy_s=prefill_busy_s,
    )


def test_slo_rate_is_the_capacity_or_where_the_per_user_slo_binds() -> None:
    slo = SLO(min_user_tok_s=30, max_ttft_s=2)
    # serving s requests/s a user sees 50 x (1 - 0.04 s): 30 at s = (1 - 30/50) / 0.04 = 10, below the capacity 1/0.08
    assert slo_rate(_candidate(8, 50.0, 0.08, 0.04), slo) == pytest.approx(10.0)
    assert slo_rate(_candidate(8, 50.0, 0.125, 0.04), slo) == pytest.approx(8.0)  # the capacity binds first
    assert slo_rate(_candidate(8, 50.0, 0.08, 0.04), SLO()) == pytest.approx(12.5)  # no per-user SLO: the capacity
    assert slo_rate(_candidate(8, 25.0, 0.08, 0.04), slo) == 0.0  # decode steps alone are slower than the SLO
    assert slo_rate(_candidate(8, 50.0, 0.08, 0.04, ttft_s=3.0), slo) == 0.0
    with pytest.raises(ValueError, match="busy seconds"):
        slo_rate(replace(_priced(), busy_s=None), slo)


def test_a_remainder_replica_replaces_a_second_large_one() -> None:
    slo = SLO(min_user_tok_s=30)
    big = _candidate(8, 50.0, 0.08, 0.04)  # 10 requests/s within the SLO
    small = _candidate(2, 40.0, 0.5, 0.25)  # (1 - 30/40) / 0.25 = 1 request/s
    fleet = best_fleet([big, small], slo, 10.5)
    assert fleet is not None and fleet.mixed and fleet.accelerators == 10  # against 2 x 8 = 16
    (main_part, rest) = fleet.parts
    assert (main_part.replicas, main_part.served_rps, rest.replicas) == (1, pytest.approx(10.0), 1)
    assert rest.served_rps == pytest.approx(0.5) and rest.user_tok_s() == pytest.approx(40 * (1 - 0.5 * 0.25))
    assert main_part.user_tok_s() == pytest.approx(30.0)  # at its SLO rate a replica's users see the SLO itself
    # up to 10 requests/s one large replica serves it; past 11 the remainder is beyond the small one, so two large ones
    assert best_fleet([big, small], slo, 10.0) == homogeneous(big, slo, 10.0)
    over = best_fleet([big, small], slo, 11.5)
    assert over is not None and not over.mixed and over.accelerators == 16 and over.parts[0].served_rps == pytest.approx(5.75)
    # a layout whose own replicas are cheaper wins outright: 3 x 4 accelerators at 4 requests/s each
    medium = _candidate(4, 50.0, 0.1, 0.1 * (1 - 30 / 50) / 0.4)
    assert slo_rate(medium, slo) == pytest.approx(4.0)
    cheapest = best_fleet([big, small, medium], slo, 10.5)
    assert cheapest is not None and cheapest.accelerators == 10  # 1 x 8 + 1 x 2 still beats 3 x 4 = 12
    assert best_fleet([big, small, medium], slo, 8.0) == homogeneous(medium, slo, 8.0)  # 2 x 4 = 8 ties 1 x 8; fewer acc-s first
    assert best_fleet([small], SLO(min_user_tok_s=45), 1.0) is None
    with pytest.raises(ValueError, match="rate"):
        best_fleet([big], slo, 0.0)


def test_cli_reports_the_step_and_the_smaller_fleet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/planner.md's Qwen3-235B example: an 8-GPU replica serves just under 10 requests/s, so the homogeneous fleet
    is two; one 8-GPU replica at its SLO rate and a 2-GPU one for the rest serve it on 10."""
    model = hf.write(tmp_path, hf.qwen3_moe())
    args = ["plan", "--model", str(model), "--hardware", "hgx-h200", "--input", "4k", "--output", "1k", "--rate", "10", "--min-user-tok-s", "30"]
    args += ["--max-ttft", "2", "--expert-dtype", "fp8", "--trunk-dtype", "fp8", "--kv-dtype", "fp8", "--max-accelerators", "64"]
    assert main([*args, "--json"]) == 0
    w = json.loads(capsys.readouterr().out)["workload"]
    fleet, demand = w["fleet"], w["demand"]
    assert fleet["accelerators"] < demand["accelerators"]
    assert math.fsum(p["replicas"] * p["served_rps"] for p in fleet["parts"]) == pytest.approx(10.0)
    assert all(p["served_rps"] <= p["slo_rps"] + 1e-9 and p["user_tok_s"] >= 30 - 1e-6 for p in fleet["parts"])
    assert w["headline_slo_rps"] < 10 <= demand["replicas"] * demand["replica_rps"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "fleet step: one replica of this layout serves at most" in out and "fewer accelerators with a remainder replica" in out
