"""Issue 20 item 10: pipeline and context parallelism for 1M-token prefill (TTFT, bubble, ring attention, KDA state
hand-off), inside the search when the user allows them, and labelled as not runnable by openk3."""

from __future__ import annotations

import math
import re

import pytest

from openk3.config import debug, k3
from openk3.planner.cli import main
from openk3.planner.hardware import Vendor, load_catalogue
from openk3.planner.inputs import Layout, Quantisation, Workload
from openk3.planner.memory import attn_res_slots, cache_spec
from openk3.planner.models import deepseek_v3
from openk3.planner.perf import Efficiency, Scenario, evaluate
from openk3.planner.plan import PlanRequest, make_plan
from openk3.planner.pp_cp import SCAN_WORK, KDASplit, cp_bytes, fix_ttft, hop_bytes, layout_problem, long_prefill
from openk3.planner.runtime import support
from openk3.planner.search import SLO, SearchSpace
from openk3.planner.workload import RequestMix

M = 1 << 20


def _sc(tp: int = 1, n: int = 72, config: object = None) -> Scenario:
    lay = Layout(n, tp=tp)
    cfg = config or k3()
    return Scenario(cfg, Quantisation(), lay, Workload(context=M, concurrency=lay.dp, prompt=M), load_catalogue().system("gb300-nvl72"))  # type: ignore[arg-type]


def test_neither_is_the_plain_ttft() -> None:
    sc = _sc()
    lp = long_prefill(sc)
    assert lp.ttft_s == pytest.approx(evaluate(sc).ttft_s) == pytest.approx(lp.plain_ttft_s)
    # one DP-attention GPU runs a 1M-token prompt alone: not even at the roofline (~400 s) could it meet a minute
    roofline = long_prefill(sc.with_(efficiency=Efficiency.ideal())).plain_ttft_s
    assert lp.plain_ttft_s > roofline > 6 * 60


def test_pipeline_fill_and_bubble() -> None:
    sc = _sc()
    one, pp8 = long_prefill(sc), long_prefill(sc, pp=8)
    chunks = math.ceil(M / 8192)
    assert pp8.bubble == pytest.approx(7 / (chunks + 7))
    assert pp8.ttft_s == pytest.approx((chunks + 7) * (pp8.stage_s + pp8.hop_s))
    # a hop carries the chunk's residual stream and AttnRes summaries, bf16, over NVLink (72 GPUs in one domain)
    assert hop_bytes(sc, 8192) == 8192 * k3().hidden_size * 2 * (1 + attn_res_slots(k3()))
    assert one.ttft_s / pp8.ttft_s == pytest.approx(8 * chunks / (chunks + 7), rel=0.05)
    assert pp8.decode_hop_s > 0 and one.decode_hop_s == 0


def test_context_parallel_ring_and_kda_assumptions() -> None:
    sc = _sc()
    seq, scan = long_prefill(sc, cp=8, kda=KDASplit.SEQUENTIAL), long_prefill(sc, cp=8, kda=KDASplit.SCAN)
    plain = long_prefill(sc)
    spec = cache_spec(k3(), Quantisation())
    bw = sc.system.accelerator.scale_up_bw * sc.comm.scale_up_efficiency
    assert seq.ring_s == pytest.approx(7 / 8 * M * spec.mla.bytes_per_token / bw)
    assert seq.ring_exposed_s == 0  # hidden under each rank's attention
    assert seq.chunks_per_rank == math.ceil(M / 8 / 8192)
    # sequential KDA: the recurrence is not divided by cp and its state hops cp - 1 times per layer; a scan is cheaper
    assert seq.kda_extra_s > scan.kda_extra_s > 0
    assert plain.ttft_s / 8 < scan.ttft_s < seq.ttft_s < plain.ttft_s / 7
    assert SCAN_WORK < 8
    # a model without KDA pays nothing for the recurrence
    ds = _sc(tp=8, n=64, config=deepseek_v3())
    assert long_prefill(ds, cp=8).kda_extra_s == 0


def test_layout_problems_name_the_split() -> None:
    sc = _sc(tp=8)
    assert "stages of whole TP8 groups" in (layout_problem(sc, 2, 1) or "")
    assert "9 attention groups" in (layout_problem(sc, 1, 8) or "")
    assert layout_problem(sc, 1, 9) is None
    with pytest.raises(ValueError, match="cp=8"):
        long_prefill(sc, cp=8)


def test_fix_picks_the_least_split_that_meets_the_slo() -> None:
    sc = _sc()
    lp = fix_ttft(sc, 60.0, max_pp=8, max_cp=16, kda=KDASplit.SEQUENTIAL)
    assert lp is not None and lp.ttft_s <= 60
    for pp in (1, 2, 4, 8):
        for cp in range(1, 17):
            if pp * cp < lp.pp * lp.cp and layout_problem(sc, pp, cp) is None:
                assert long_prefill(sc, pp, cp).ttft_s > 60
    assert fix_ttft(sc, 60.0, 1, 1, KDASplit.SEQUENTIAL) is None


def test_search_meets_a_1m_ttft_slo_only_with_pp_cp() -> None:
    system = load_catalogue().system("gb300-nvl72")
    slo = SLO(max_ttft_s=60)
    plain = make_plan(PlanRequest(config=k3(), system=system, context=M, slo=slo, space=SearchSpace(max_accelerators=72)))
    assert plain.choice is None and "no layout meets the SLO" in (plain.problem or "")
    space = SearchSpace(max_accelerators=72, max_pp=8, max_cp=16)
    plan = make_plan(PlanRequest(config=k3(), system=system, context=M, slo=slo, space=space))
    assert plan.choice is not None and plan.choice.long_prefill is not None
    assert plan.choice.metrics.ttft_s <= 60 < plan.choice.long_prefill.plain_ttft_s
    runs = plan.support
    assert runs is not None and not runs.openk3 and runs.engines == ()  # no engine documents CP over a KDA recurrence
    assert any("no pipeline parallelism" in m or "no context parallelism" in m for m in runs.openk3_missing)


def test_pp_alone_is_runnable_by_engines_not_openk3() -> None:
    sc = _sc()
    runs = support(Layout(1), 0.0, Quantisation(), Vendor.NVIDIA, long_prefill(sc, pp=8))
    assert not runs.openk3 and runs.engines and "PP8" in runs.openk3_missing[0]


def test_cli_flags(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--context", "1m", "--max-ttft", "60", "--max-accelerators", "72"]
    assert main(args) == 1
    capsys.readouterr()
    assert main([*args, "--max-pp", "8", "--max-cp", "16", "--kda-cp", "scan"]) == 0
    out = capsys.readouterr().out
    split = re.search(r"\(KDA scan\): TTFT ([\d,.]+) s -> ([\d.]+) s", out)
    assert split is not None and float(split[1].replace(",", "")) > 60 >= float(split[2]) and "bubble" in out


def test_workload_times_use_the_split_the_plan_prefills_with() -> None:
    """A workload plan whose headline needs PP/CP reports per-request prefill times of that split, not of a prompt run
    on one group (772 s here, against the headline's TTFT under 60 s)."""
    mix = RequestMix(((1_000_000, 2048),), 0.05)
    system = load_catalogue().system("gb300-nvl72")
    space = SearchSpace(max_accelerators=72, max_pp=8, max_cp=16)
    req = PlanRequest(config=k3(), system=system, context=mix.decode_context, prompt=mix.ttft_prompt, requests=mix, slo=SLO(max_ttft_s=60), space=space)
    plan = make_plan(req)
    assert plan.choice is not None and plan.choice.long_prefill is not None and plan.demand is not None
    assert plan.demand.prefill_s.max == pytest.approx(plan.choice.metrics.ttft_s)
    assert plan.demand.prefill_s.max <= 60


def test_cp_bytes_are_what_the_cp_prefill_receives() -> None:
    # debug(): latent R = 40, KDA 2 heads x 16 x 16 fp32 state + 96 conv channels x 3 window; fp32 cache as on CPU
    cfg = debug()
    sent = cp_bytes(cfg, Quantisation(cache_dtype_bytes=4), tp=1, prompt=150, cp=2)
    assert sent.mla_per_layer == 75 * 40 * 4
    assert sent.kda_hop == 2 * 16 * 16 * 4 + 96 * 3 * 4
    assert sent.kda_hops_per_layer == 1 and sent.gather == len(cfg.mla_layers) * sent.mla_per_layer
    # the scan (parallel/cp/kda_scan.py): a hand-on round, then ceil(log2(cp - 1)) doubling rounds, each at most one
    # state map [B | A] ([H, K, V + K] fp32) per rank, beside the predecessor's conv windows -- what
    # tests/parallel/test_cp_kda_scan.py measures on the busiest rank
    assert [cp_bytes(cfg, Quantisation(), tp=1, prompt=150, cp=c, kda=KDASplit.SCAN).kda_hops_per_layer for c in (2, 3, 5, 8, 9)] == [1, 2, 3, 4, 4]
    scan = cp_bytes(cfg, Quantisation(cache_dtype_bytes=4), tp=1, prompt=150, cp=3, kda=KDASplit.SCAN)
    assert scan.kda_map == 2 * 16 * (16 + 16) * 4
    assert scan.kda_per_rank == 96 * 3 * 4 + 2 * scan.kda_map
    assert cp_bytes(cfg, Quantisation(cache_dtype_bytes=4), tp=1, prompt=150, cp=3).kda_per_rank == sent.kda_hop
    assert cp_bytes(cfg, Quantisation(), tp=1, prompt=150, cp=1).gather == 0
