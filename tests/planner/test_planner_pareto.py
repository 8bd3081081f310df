"""Issue 20 item 11: the SLO-constrained Pareto front of the whole search (JSON rows, text, plot) and the decode
step's bytes by flow, the expert all-to-all split into scale-up and scale-out."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from openk3.config import k3
from openk3.planner.cli import main
from openk3.planner.comm import copies_per_token, expected_destination_ranks
from openk3.planner.hardware import load_catalogue
from openk3.planner.inputs import Balance, Layout, Quantisation, Workload
from openk3.planner.memory import num_moe_layers
from openk3.planner.pareto import front, pareto_rows
from openk3.planner.perf import Scenario, decode_step
from openk3.planner.plan import Plan, PlanRequest, make_plan
from openk3.planner.search import SLO, SearchSpace
from openk3.planner.traffic import step_traffic

SLO20 = SLO(min_user_tok_s=20, max_ttft_s=10)


def _plan(slo: SLO = SLO20) -> Plan:
    system = load_catalogue().system("gb300-nvl72")
    return make_plan(PlanRequest(config=k3(), system=system, context=32768, slo=slo, space=SearchSpace(max_accelerators=72)))


def test_front_is_the_non_dominated_feasible_set() -> None:
    plan = _plan()
    rows = plan.front
    assert len(rows) == len(plan.search.candidates) > 100
    pts = [(r.per_user_tok_s, r.per_accelerator_tok_s) for r in rows]
    for r, p in zip(rows, pts, strict=True):
        # brute force: on the front <=> feasible and no feasible point is >= on both axes and > on one
        dominated = any(q[0] >= p[0] and q[1] >= p[1] and q != p for q, o in zip(pts, rows, strict=True) if o.feasible)
        if r.pareto:
            assert r.feasible and not dominated
        elif r.feasible and not dominated:  # only an exact twin of a point already on the front is left off
            assert any(o.pareto and q == p for q, o in zip(pts, rows, strict=True))
        assert r.feasible == r.candidate.meets_slo
    edge = front(rows)
    assert all(r.candidate.metrics.per_user_tok_s >= SLO20.min_user_tok_s for r in edge)
    speeds = [r.per_user_tok_s for r in edge]
    assert speeds == sorted(speeds, reverse=True)
    thr = [r.per_accelerator_tok_s for r in edge]
    assert thr == sorted(thr)  # along the front, giving up per-user speed buys throughput
    # the headline is the cheapest per output token, i.e. the most tokens per accelerator at one price: the front's end
    assert plan.choice is not None and edge[-1].candidate is plan.choice


def test_front_shrinks_under_a_tighter_slo() -> None:
    loose, tight = _plan(SLO()), _plan(SLO(min_user_tok_s=40))
    assert sum(r.feasible for r in tight.front) < sum(r.feasible for r in loose.front)
    assert min(r.per_user_tok_s for r in front(tight.front)) >= 40
    assert pareto_rows(()) == ()


def test_json_rows_and_text(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--context", "32k", "--min-user-tok-s", "20", "--max-ttft", "10", "--max-accelerators", "72"]
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["search"]["candidates"]
    assert all({"pareto", "meets_slo", "per_user_tok_s", "tok_s_per_accelerator"} <= set(r) for r in rows)
    on = [r for r in rows if r["pareto"]]
    assert on and all(r["meets_slo"] for r in on) and len(doc["pareto"]) == len(on)
    t = doc["traffic"]
    assert t["a2a_scale_out"] == 0 and t["a2a_scale_up"] > 0  # EP72 inside one NVL72 domain
    assert t["weights"] > 0 and t["kv_state"] > t["a2a"]
    assert all({"weights", "kv_state", "a2a_scale_up", "a2a_scale_out"} <= set(r["traffic"]) for r in rows)
    assert doc["search"]["best"]["traffic"]["a2a_scale_up"] == pytest.approx(t["a2a_scale_up"])  # the headline's own row
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "Pareto front of the whole search" in out and "expert all-to-all, scale-out (NIC)" in out


def test_a2a_bytes_per_token_match_the_seed() -> None:
    """EP72, one sequence per rank, no imbalance: each token sends its dispatch copies and gets the combines back."""
    c, q = k3(), Quantisation()
    sc = Scenario(c, q, Layout(72, tp=1, balance=Balance.MOONEP), Workload(context=8192, concurrency=72), load_catalogue().system("gb300-nvl72"))
    step = decode_step(sc)
    assert step.imbalance == 1.0
    t = step_traffic(sc, step)
    remote, _ = copies_per_token(c, 72, dedup=True)
    one_way = num_moe_layers(c) * remote * (3696 + 7168)
    assert t.a2a_per_token == pytest.approx(2 * one_way)  # sent + received, equal at balance
    # spec section 1: 14.4 MB per token at EP72 with de-duplication, which counts the local copy as well
    with_local = num_moe_layers(c) * expected_destination_ranks(896, 16, 72) * (3696 + 7168)
    assert with_local == pytest.approx(14.4e6, rel=0.01)
    assert one_way < with_local and one_way == pytest.approx(with_local, rel=0.03)
    assert t.weights + t.kv_state == pytest.approx(step.bytes)


def test_scale_out_share_follows_the_domain() -> None:
    c, q = k3(), Quantisation()
    h200 = load_catalogue().system("hgx-h200")  # 8-GPU NVLink domain
    sc = Scenario(c, q, Layout(16, tp=1), Workload(context=8192, concurrency=16 * 8), h200)
    t = step_traffic(sc)
    assert t.a2a_scale_out / t.a2a == pytest.approx(8 / 15)  # 8 of the 15 remote peers are behind the NIC
    inside = step_traffic(sc.with_(layout=Layout(8, tp=1), workload=Workload(context=8192, concurrency=64)))
    assert inside.a2a_scale_out == 0 and inside.a2a_scale_up > 0
    tp = step_traffic(sc.with_(layout=Layout(16, tp=2)))
    assert tp.allreduce_scale_up > 0 and tp.allreduce_scale_out == 0


def test_plot_draws_the_front(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib (the optional plot extra) is not installed")
    for name, magic in (("plan.png", b"\x89PNG"), ("plan.svg", b"<?xml")):
        out = tmp_path / name
        assert main(["plan", "--context", "32k", "--min-user-tok-s", "20", "--max-accelerators", "72", "--plot", str(out)]) == 0
        assert out.read_bytes()[:5].startswith(magic)
    capsys.readouterr()
