"""Issue 20, defects 3-7: prefill attention work, TP sizes that split the heads, honest JSON and text, communication
priced where it runs, batches off the power-of-two grid, and who can run a layout."""

from __future__ import annotations

import json
import math

import pytest

from openk3.config import debug, k3
from openk3.planner import (
    SLO,
    Balance,
    CommParams,
    Efficiency,
    Layout,
    PlanRequest,
    PowerParams,
    Quantisation,
    Scenario,
    SearchSpace,
    Workload,
    evaluate,
    load_catalogue,
    make_plan,
    min_accelerators,
    prefill_batch_step,
    prefill_step,
    render_json,
    render_text,
    search,
    support,
)
from openk3.planner.cli import main
from openk3.planner.comm import allreduce_time
from openk3.planner.hardware import Vendor
from openk3.planner.memory import candidate_tps

CAT = load_catalogue()
GB300, H200 = CAT.system("gb300-nvl72"), CAT.system("hgx-h200")
Q = Quantisation()
FAST = ["--max-accelerators", "72"]


def _mla_flops(sc: Scenario, step_kv: float | None = None) -> float:
    return next(c.flops for c in prefill_step(sc, step_kv).components if c.name == "mla_attention")


# defect 3: prefill attention FLOPs were counted at half (the cached length halved twice)


def test_one_chunk_prefill_attention_counts_every_causal_pair() -> None:
    config, p = k3(), 8192
    sc = Scenario(config, Q, Layout(72, tp=1), Workload(p, 72, prefill_chunk=p), GB300)
    m, n_mla = config.mla, len(config.mla_layers)
    pairs = p * (p + 1) / 2  # query i attends to keys 0..i
    assert _mla_flops(sc) == pytest.approx(n_mla * 2 * m.num_heads * pairs * (m.qk_head_dim + m.v_head_dim))


def test_chunked_prefill_middle_chunk_times_chunks_is_the_whole_prompt() -> None:
    config, p, c = k3(), 32768, 4096
    sc = Scenario(config, Q, Layout(72, tp=1), Workload(p, 72, prefill_chunk=c), GB300)
    per_chunk = [_mla_flops(sc, float(k * c)) for k in range(p // c)]  # chunk k sees k*c cached tokens
    assert sum(per_chunk) == pytest.approx(_mla_flops(sc) * (p // c))
    m = config.mla
    assert sum(per_chunk) == pytest.approx(len(config.mla_layers) * 2 * m.num_heads * p * (p + 1) / 2 * (m.qk_head_dim + m.v_head_dim))


# defect 4: TP sizes must divide the attention heads


def test_min_accelerators_and_search_use_only_tps_that_divide_the_heads() -> None:
    empty = Workload(context=1, concurrency=0)
    layout = min_accelerators(k3(), Q, empty, GB300)
    assert layout is not None and 96 % layout.tp == 0  # was TP7 on 7 GB300s
    assert candidate_tps(7, GB300, config=k3()) == [1]
    result = search(k3(), Q, GB300, 8192, space=SearchSpace(sizes=(7, 144), balances=(Balance.EPLB,), redundancy=False))
    assert result.candidates and all(96 % c.layout.tp == 0 for c in result.candidates)


def test_user_tp_that_splits_a_head_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="tp=7 does not divide 96 MLA heads"):
        PlanRequest(config=k3(), system=GB300, context=8192, tp=7)
    assert main(["plan", "--accelerators", "14", "--tp", "7", *FAST]) == 2
    assert "does not divide 96" in capsys.readouterr().err


# defect 6: valid JSON with every input echoed and every candidate; honest text


def _json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    rc = main(argv)

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} is not JSON")

    return rc, json.loads(capsys.readouterr().out, parse_constant=refuse)


def test_json_is_valid_and_echoes_the_inputs(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--context", "8k", "--accelerators", "72", "--price", "3.1", "--eff-hbm", "0.7", "--json", *FAST]
    rc, doc = _json(argv, capsys)
    assert rc == 0
    inputs = doc["inputs"]
    assert inputs["price"] == {"usd_per_accelerator_hour": 3.1, "source": "user input", "placeholder": False}
    assert inputs["efficiency"]["hbm"] == 0.7 and inputs["efficiency"]["comm_overlap"] == 0.7
    assert inputs["slo"] == {"min_user_tok_s": 0.0, "max_ttft_s": None}  # infinity is not JSON
    assert inputs["quantisation"]["expert_bits"] == 4.25 and inputs["fill"] == 0.9
    assert inputs["system"]["scale_out_bw"]["source"] and inputs["accelerator"]["hbm_bw"]["value"] == 8e12
    assert inputs["power"]["hbm"] == PowerParams().hbm
    plan = make_plan(PlanRequest(config=k3(), system=GB300, context=8192, accelerators=72, space=SearchSpace(max_accelerators=72)))
    assert len(doc["search"]["candidates"]) == len(plan.search.candidates) > len(doc["search"]["per_size"])


def test_zero_concurrency_is_a_user_error_not_infinity(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--concurrency", "0", "--json", *FAST]) == 2
    assert "concurrency=0" in capsys.readouterr().err


def test_text_keeps_three_figures_and_marks_placeholder_prices() -> None:
    plan = make_plan(PlanRequest(config=k3(), system=GB300, context=8192, accelerators=72, space=SearchSpace(max_accelerators=72)))
    text = render_text(plan)
    assert "KDA state + conv 449.4 MB" in text and "0.4 GB" not in text
    assert GB300.price_is_placeholder and "placeholder price" in text
    assert render_json(plan)["inputs"]["price"]["placeholder"] is True
    h200 = make_plan(PlanRequest(config=k3(), system=H200, context=8192, accelerators=16, space=SearchSpace(max_accelerators=16)))
    assert not H200.price_is_placeholder and "placeholder" not in render_text(h200)  # LMSYS's published $2.3


def test_power_follows_the_load_and_prefill_energy_is_reported() -> None:
    small = evaluate(Scenario(k3(), Q, Layout(72, tp=1), Workload(8192, 72), GB300))
    big = evaluate(Scenario(k3(), Q, Layout(72, tp=1), Workload(8192, 72 * 256), GB300))
    assert small.decode_power_w < big.decode_power_w < GB300.power_w
    assert big.prefill_tokens_per_joule == pytest.approx(big.prefill_tok_s / (72 * big.prefill_power_w))
    nameplate = evaluate(Scenario(k3(), Q, Layout(72, tp=1), Workload(8192, 72), GB300, power=PowerParams.nameplate()))
    assert nameplate.decode_power_w == pytest.approx(GB300.power_w)


# defect 5: communication priced where it runs, overlap only with two micro-batches, packed prefill, exact batch


def test_tp_across_nodes_runs_at_nic_speed() -> None:
    comm, nbytes = CommParams(), 1e8
    inside = allreduce_time(nbytes, 8, H200, comm)
    across = allreduce_time(nbytes, 16, H200, comm)
    assert across >= comm.allreduce_floor_s + 2 * 15 / 16 * nbytes / (H200.scale_out_bw * comm.scale_out_efficiency)
    assert across > 5 * inside


def test_no_overlap_at_one_sequence_per_group() -> None:
    one = evaluate(Scenario(k3(), Q, Layout(72, tp=1), Workload(8192, 72), GB300, efficiency=Efficiency(comm_overlap=0.7)))
    assert one.decode.exposed_comm_s == pytest.approx(one.decode.comm_s)
    many = evaluate(Scenario(k3(), Q, Layout(72, tp=1), Workload(8192, 72 * 64), GB300, efficiency=Efficiency(comm_overlap=0.7)))
    assert many.decode.exposed_comm_s < many.decode.comm_s


def test_prefill_packs_short_prompts() -> None:
    sc = Scenario(k3(), Q, Layout(72, tp=1), Workload(2500, 72, prompt=2000, prefill_chunk=8192), GB300)
    assert prefill_batch_step(sc).tokens_per_group == 4 * 2000
    assert prefill_step(sc).tokens_per_group == 2000  # TTFT: one prompt alone
    # a 128-token prompt alone streams the whole trunk for little compute; 64 of them per step share that read
    short = evaluate(sc.with_(workload=Workload(256, 72, prompt=128, prefill_chunk=8192)))
    assert short.prefill_tok_s > 1.3 * 128 * 72 / short.prefill.total_s  # 1.41x: the trunk turns compute-bound


def test_slo_batch_is_the_largest_that_meets_it() -> None:
    space = SearchSpace(sizes=(72,), tps=(2,), balances=(Balance.EPLB,), redundancy=False)
    slo = SLO(min_user_tok_s=20)
    best = search(k3(), Q, GB300, 8192, slo, space=space).best
    assert best is not None and best.meets_slo
    one_more = Workload(8192, (best.seqs_per_group + 1) * best.layout.dp)
    m = evaluate(Scenario(k3(), Q, best.layout, one_more, GB300, Efficiency().capturing(best.seqs_per_group + 1)))  # as the search prices it
    assert m.per_user_tok_s < 20 or not m.memory.fits


# defect 7: each layout says whether openk3 runs it today, and which engines can

BF16_DISPATCH = Quantisation(dispatch_bits=16)  # what openk3 dispatches (the activation dtype)


def test_layouts_say_who_can_run_them(capsys: pytest.CaptureFixture[str]) -> None:
    tp2 = support(Layout(72, tp=2), 0.7, Q, Vendor.NVIDIA)
    assert not tp2.openk3 and any("two-batch overlap" in r for r in tp2.openk3_missing) and "SGLang" in tp2.engines
    assert support(Layout(1), 0.7, Q, Vendor.NVIDIA).openk3
    assert support(Layout(72, balance=Balance.MOONEP), 0.7, Q, Vendor.NVIDIA).engines == ()
    # openk3 runs TP over all ranks (tp=N), DP attention with TP inside each group, and EP over all ranks: what is
    # missing then is the rest
    cuda_only = ("multi-rank serving on CUDA/NCCL (run on CPU/gloo only)",)
    for tp in (8, 2, 1):
        assert support(Layout(8, tp=tp), 0.0, BF16_DISPATCH, Vendor.NVIDIA).openk3_missing == cuda_only, tp
    assert any("replicated 2x" in r for r in support(Layout(8, tp=8, ep=4), 0.0, BF16_DISPATCH, Vendor.NVIDIA).openk3_missing)
    rc, doc = _json(["plan", "--context", "8k", "--accelerators", "72", "--balance", "eplb", "--json", *FAST], capsys)
    assert rc == 0 and doc["runnable"]["openk3"] is False and doc["runnable"]["engines"]
    assert all("runnable" in c for c in doc["search"]["candidates"])
    small = make_plan(PlanRequest(config=debug(), system=CAT.system("hgx-h100"), context=128, accelerators=1, quant=Quantisation.named("bf16")))
    assert small.support is not None and small.support.openk3 and "openk3: yes" in render_text(small)
    assert math.isfinite(small.metrics.usd_per_m_output) if small.metrics else False
