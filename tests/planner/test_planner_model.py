"""Behaviour of the memory, balance, search, tier and calibration models on cases small enough to reason about."""

from __future__ import annotations

import math

import pytest

from openk3.config import debug, k3
from openk3.planner import (
    SLO,
    Balance,
    BalanceParams,
    Efficiency,
    Layout,
    Measurement,
    Quantisation,
    Scenario,
    SearchSpace,
    Workload,
    break_even_tokens,
    calibrate,
    evaluate,
    k3_all_mla,
    load_catalogue,
    max_concurrency,
    parse_tokens,
    rank_imbalance,
    search,
    working_set,
)
from openk3.planner.memory import trunk_bytes_per_rank, workspace_bytes_per_token

CAT = load_catalogue()
GB300 = CAT.system("gb300-nvl72")
Q = Quantisation()


def test_parse_tokens() -> None:
    assert parse_tokens("32k") == 32768 and parse_tokens("1m") == 1 << 20 and parse_tokens("2000") == 2000
    with pytest.raises(ValueError, match="'abc'"):
        parse_tokens("abc")


def test_layout_and_workload_validation() -> None:
    with pytest.raises(ValueError, match="Layout.tp=3"):
        Layout(8, tp=3)
    with pytest.raises(ValueError, match="Workload.context=0"):
        Workload(context=0, concurrency=1)
    with pytest.raises(ValueError, match="unknown quantisation"):
        Quantisation.named("int3")


def test_max_concurrency_is_the_largest_batch_that_fits() -> None:
    layout = Layout(72, tp=1)
    n = max_concurrency(k3(), Q, layout, 32768, GB300)
    assert n > 0 and n % layout.dp == 0
    assert working_set(k3(), Q, layout, Workload(32768, n), GB300).fits
    assert not working_set(k3(), Q, layout, Workload(32768, n + layout.dp), GB300).fits


def test_kda_saves_hbm_against_all_mla_at_long_context() -> None:
    layout = Layout(72, tp=1)
    for ctx in (131072, 1 << 20):
        hybrid = working_set(k3(), Q, layout, Workload(ctx, 72), GB300).cache
        all_mla = working_set(k3_all_mla(), Q, layout, Workload(ctx, 72), GB300).cache
        assert all_mla / hybrid > 3  # 93 vs 24 latent layers, minus the fixed 449 MB state


def test_tp_shards_the_state_but_not_the_latent() -> None:
    w = Workload(8192, 64)
    dp = working_set(k3(), Q, Layout(8, tp=1), w, GB300)
    tp = working_set(k3(), Q, Layout(8, tp=8), w, GB300)
    assert tp.mla_cache == dp.mla_cache * 8  # all 64 sequences' latent on every TP rank
    assert tp.kda_state == pytest.approx(dp.kda_state)  # 64/8 sequences x full state == 64 sequences x 1/8 state
    # TP splits 51.0B of the 56.7B trunk; the rest (latent MoE projections, router, q_a/kv_a, norms) stays whole per rank
    assert tp.trunk == pytest.approx(trunk_bytes_per_rank(k3(), Q, 8)) and dp.trunk / 8 < tp.trunk < dp.trunk / 4
    assert workspace_bytes_per_token(k3(), Layout(8, tp=8)) < workspace_bytes_per_token(k3(), Layout(8, tp=1))


def test_imbalance_policies_order() -> None:
    params = BalanceParams()
    m = 1024.0
    none = rank_imbalance(k3(), Layout(72, balance=Balance.NONE), m, params)
    eplb = rank_imbalance(k3(), Layout(72, balance=Balance.EPLB), m, params)
    moon = rank_imbalance(k3(), Layout(72, balance=Balance.MOONEP), m, params)
    assert none > eplb > moon == 1.0
    # the default calibration point: DeepSeek-R1, 288 slots on 32 ranks, large batch -> 2.56 and 1.11 (TRT-LLM)
    from openk3.planner import deepseek_v3

    big = 1e9
    assert rank_imbalance(deepseek_v3(), Layout(32, redundant_experts=32, balance=Balance.NONE), big, params) == pytest.approx(2.56, abs=0.03)
    assert rank_imbalance(deepseek_v3(), Layout(32, redundant_experts=32, balance=Balance.EPLB), big, params) == pytest.approx(1.11, abs=0.01)
    assert rank_imbalance(k3(), Layout(1), m, params) == 1.0


def test_search_meets_slo_at_lowest_cost_and_labels_binding() -> None:
    space = SearchSpace(sizes=(8, 72), tps=(1, 2, 8), balances=(Balance.EPLB,), redundancy=False)
    result = search(k3(), Q, GB300, 32768, SLO(min_user_tok_s=20, max_ttft_s=20), space=space)
    feasible = result.feasible
    assert feasible and all(c.meets_slo for c in feasible)
    assert [c.metrics.usd_per_m_output for c in feasible] == sorted(c.metrics.usd_per_m_output for c in feasible)
    for c in result.candidates:
        assert c.metrics.binding in ("memory", "HBM bandwidth", "compute", "interconnect")
        assert c.meets_slo == (c.metrics.per_user_tok_s >= 20 and c.metrics.ttft_s <= 20)
    assert result.best is not None
    assert result.best.layout.num_accelerators == 72
    at8 = [c for c in result.candidates if c.layout.num_accelerators == 8]
    fullest = max(at8, key=lambda c: c.concurrency)  # 8 GB300s hold the weights but almost no cache
    assert fullest.batch_cap == "memory" and fullest.metrics.binding == "memory" and fullest.concurrency < 72
    assert result.best_per_size()[8].concurrency <= fullest.concurrency


def test_small_batch_over_the_nic_is_interconnect_bound() -> None:
    h200 = CAT.system("hgx-h200")
    # TP16 spans two nodes (its all-reduces cross the NIC); at TP8 the 24 GB each rank reads per step (the replicated
    # part of the trunk included) outweighs the all-to-all at batch 4. Flat factors: the measured GEMM curves read a
    # batch of 4 well under 80% of HBM bandwidth, and then the reads (9.1 ms) outweigh the NIC (7.4 ms) here too
    sc = Scenario(k3(), Q, Layout(32, tp=16), Workload(4096, 4), h200, efficiency=Efficiency(comm_overlap=0.0, kernels="flat"))
    assert evaluate(sc).binding == "interconnect"


def test_large_batch_prefill_is_compute_bound() -> None:
    sc = Scenario(k3(), Q, Layout(72, tp=1), Workload(32768, 72, prefill_chunk=16384), GB300)
    m = evaluate(sc)
    by = m.prefill.time_by_bound()
    assert by["compute"] > by["hbm"]


def test_offload_break_even_orders_tiers() -> None:
    sc = Scenario(k3(), Q, Layout(72, tp=1), Workload(32768, 64 * 72), GB300)
    dram, nvme = break_even_tokens(sc, "host_dram"), break_even_tokens(sc, "nvme")
    assert dram is not None and nvme is not None and dram < nvme  # the 449 MB KDA snapshot is a fixed reload cost


def test_calibrate_recovers_known_efficiencies() -> None:
    truth = Efficiency(hbm=0.7, gemm=0.35, attention=0.3, comm_overlap=0.5, kernels="flat")  # the flat factors' fit
    cases = [Workload(8192, b * 72) for b in (1, 16, 256)]
    ms = []
    for w in cases:
        sc = Scenario(k3(), Q, Layout(72, tp=1), w, GB300, efficiency=truth)
        ms.append(Measurement(sc.with_(efficiency=Efficiency.flat()), evaluate(sc).decode.total_s))
    fit = calibrate(ms, factors=("hbm", "gemm"), start=Efficiency(attention=0.3, comm_overlap=0.5, kernels="flat"))
    assert fit.efficiency.hbm == pytest.approx(0.7, rel=0.02)
    assert fit.efficiency.gemm == pytest.approx(0.35, rel=0.05)
    assert max(abs(e) for e in fit.errors) < 0.01
    with pytest.raises(ValueError, match="factors"):
        calibrate(ms, factors=("magic",))


def test_debug_model_plans_without_errors() -> None:
    sc = Scenario(debug(), Quantisation(expert_bits=16, expert_compute="bf16"), Layout(2, tp=1), Workload(128, 4), CAT.system("hgx-h100"))
    m = evaluate(sc)
    assert m.memory.fits and math.isfinite(m.usd_per_m_output) and m.per_user_tok_s > 0
