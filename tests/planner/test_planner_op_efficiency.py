"""Measured per-operator curves (issue 37 item 1): interpolation, the shipped table, the step model using them, overheads."""

from __future__ import annotations

import dataclasses
import math
import statistics

import pytest

from openk3.planner.dtypes import with_dtypes
from openk3.planner.hardware import load_catalogue
from openk3.planner.inputs import Layout, Quantisation, Workload
from openk3.planner.models import deepseek_v3
from openk3.planner.op_efficiency import Curve, Grid, curves_for, origin
from openk3.planner.overheads import Overheads
from openk3.planner.perf import Efficiency, Scenario, decode_step
from openk3.planner.steps import Component
from openk3.planner.validation import Split
from openk3.planner.validation_agg import AGGREGATED_CASES
from openk3.planner.validation_new import NEW_HELD_OUT_CASES


def test_curve_interpolates_in_log_shape_and_holds_the_ends() -> None:
    c = Curve.of([[1, 0.2], [100, 0.6]], "t")
    assert c.at(1) == 0.2 and c.at(100) == 0.6
    assert c.at(10) == pytest.approx(0.4)  # halfway in log10
    assert c.at(0.5) == 0.2 and c.at(1e6) == 0.6
    with pytest.raises(ValueError, match="efficiencies in"):
        Curve.of([[1, 0.0]], "bad")


def test_shipped_table_covers_nvidia_families_only_and_names_its_origin() -> None:
    hopper, blackwell = curves_for("h200-sxm"), curves_for("gb200")
    assert hopper is not None and hopper.measured_on == "h200_sxm" and curves_for("h100-sxm") is hopper
    assert blackwell is not None and blackwell.measured_on == "b200_sxm"
    assert curves_for("mi355x") is None
    assert "Apache-2.0" in origin() and "aiconfigurator" in origin()
    # fp4 GEMMs on Hopper fall back to the fp8 curve, as the hardware runs them
    assert hopper.gemm("fp4", 64) == hopper.gemm("fp8", 64)
    # decode attention is overhead-bound on a tiny call and well up the roofline on a large one
    small, large = hopper.attention_decode(128, 1, 256), hopper.attention_decode(128, 64, 1 << 15)
    assert small is not None and large is not None and small < 0.01 < 0.5 < large


def test_grid_takes_the_nearest_heads_and_interpolates_batch_in_log() -> None:
    g = Grid.of({"16": {"1": [[1, 0.1], [100, 0.3]], "100": [[1, 0.5], [100, 0.7]]}, "128": {"1": [[1, 0.9]]}}, "t")
    assert g.at(16, 10, 10) == pytest.approx((0.2 + 0.6) / 2)  # halfway in log batch, each curve halfway in log tokens
    assert g.at(20, 1000, 100) == pytest.approx(0.7)  # 20 heads is nearest 16; batches past the last hold it
    assert g.at(100, 10, 10) == pytest.approx(0.9)
    with pytest.raises(ValueError, match="head counts"):
        Grid.of({"16": {}}, "bad")


def test_decode_attention_is_not_a_function_of_tokens_read_alone() -> None:
    """Why the grid: at the same 1M cached tokens read, 512 sequences of 2K run further below the roofline than 8 of 128K
    (AIConfigurator's H200 MLA table, 128 heads), which one curve by batch x tokens cannot say."""
    hopper = curves_for("h200-sxm")
    assert hopper is not None
    many_short, few_long = hopper.attention_decode(128, 512, 2048), hopper.attention_decode(128, 8, 131072)
    assert many_short is not None and few_long is not None and many_short < 0.9 * few_long


def test_measured_decode_attention_is_the_roofline_over_the_curve() -> None:
    sys = load_catalogue().system("hgx-h200")
    sc = Scenario(deepseek_v3(), Quantisation.named("fp8"), Layout(8, tp=1), Workload(context=2000, concurrency=8 * 128), sys, Efficiency.measured())
    step = decode_step(sc)
    attn = next(c for c in step.components if c.name == "mla_attention")
    acc = sys.accelerator
    roof = max(attn.bytes / acc.hbm_bw, attn.flops / acc.flops("bf16"))
    curves = curves_for("h200-sxm")
    assert curves is not None
    measured = curves.attention_decode(128, 128, 2000)
    assert measured is not None and attn.time_s == pytest.approx(roof / measured)
    assert step.overhead_s == pytest.approx(2e-3 + 20e-6 * 128)  # the default host gap: 2 ms + 20 us x 128 sequences
    flat = decode_step(sc.with_(efficiency=Efficiency.flat()))
    assert flat.overhead_s == 0.0


def test_measured_kernels_are_the_default_and_each_mode_brings_its_overheads() -> None:
    assert Efficiency() == Efficiency.measured() and Efficiency().kernels == "measured"
    assert Efficiency().step_overheads == Overheads() and Efficiency.flat().step_overheads == Overheads.none()
    assert dataclasses.replace(Efficiency(), kernels="flat").step_overheads == Overheads.none()  # the old model, whole
    assert Efficiency.ideal().step_overheads == Overheads.none() and Efficiency.ideal().curves("h200-sxm") is None
    own = Overheads(host_gap_s=5e-3)
    assert Efficiency(kernels="flat", overheads=own).step_overheads == own  # given overheads win over the mode's
    with pytest.raises(ValueError, match="kernels"):
        Efficiency(kernels="fast")


def test_cuda_graph_padding_and_host_gap() -> None:
    o = Overheads()
    assert o.padded_batch(393) == 512 and o.padded_batch(384) == 384 and o.padded_batch(9000) == 9000
    assert Overheads.none().padded_batch(393) == 393
    assert o.host_gap(100) == pytest.approx(2e-3 + 2e-3)  # 2 ms fixed + 100 x 20 us
    with pytest.raises(ValueError, match="graph_sizes"):
        Overheads(graph_sizes=(4, 2))


def test_an_engine_captures_graphs_up_to_its_own_max_batch() -> None:
    """TensorRT-LLM's `_filter_cuda_graph_batch_sizes`: the listed sizes up to min(max batch, max tokens), then that
    bound itself (padding on, a larger size listed); a decode batch of 631 on an engine of max batch 768 pads to 768,
    not to the list's 1,024."""
    o = Overheads()
    e = o.engine(768, 2048)
    assert e.graph_sizes == (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 768)
    assert e.padded_batch(631) == 768 and o.padded_batch(631) == 1024 and e.padded_batch(300) == 384
    assert o.engine(4096, 300).graph_sizes[-2:] == (256, 300)  # the token budget bounds a pure-decode batch too
    assert o.engine(8192, 8192) == o and o.engine(512, 8192).graph_sizes[-1] == 512  # listed bound: nothing appended
    assert Overheads.none().engine(768, 2048) == Overheads.none()
    assert (e.host_gap_s, e.host_gap_per_seq_s) == (o.host_gap_s, o.host_gap_per_seq_s)
    with pytest.raises(ValueError, match="max_batch"):
        o.engine(0, 2048)


def test_aggregated_validation_reports_what_docs_say() -> None:
    """docs/planner.md: the TensorRT-LLM rows priced as the benchmark runs them (continuous.finite_run, no load
    balancer, the engine's own CUDA graphs, the CUTLASS MoE's all-gather exchange) with the Qwen3 checkpoints' FP8 KV
    cache, MLA decode over an FP8 cache on its own kernel's curve, Blackwell GQA prefill on TensorRT-LLM's table. Median
    |error| of these rows, measured kernels: tuned 9%, held-out 9%, new held-out 12% (the default, host gap 2 ms + 20 us
    since round nine; 10% / 12% / 13% with round seven's 1 ms + 20 us); the flat model: 46%, 21%, 75%. Pinned so a
    change to either model updates the docs."""

    def median(cases: tuple, split: Split, eff: Efficiency) -> float:
        errs = [c.error(eff) for c in cases if c.split == split]
        return statistics.median(abs(e) for e in errs if e is not None)

    m, flat = Efficiency(), Efficiency.flat()
    for eff, tuned, held, new in ((m, 0.09, 0.09, 0.12), (flat, 0.46, 0.21, 0.75)):
        assert math.isclose(median(AGGREGATED_CASES, Split.TUNED, eff), tuned, abs_tol=0.02)
        assert math.isclose(median(AGGREGATED_CASES, Split.HELD_OUT, eff), held, abs_tol=0.02)
        assert math.isclose(median(NEW_HELD_OUT_CASES, Split.NEW_HELD_OUT, eff), new, abs_tol=0.02)


def test_gqa_attention_has_its_own_curves_where_they_are_physical() -> None:
    hopper, blackwell = curves_for("h200-sxm"), curves_for("b200")
    assert hopper is not None and blackwell is not None
    assert hopper.attention_decode(64, 64, 4096, mla=False) != hopper.attention_decode(64, 64, 4096)
    assert hopper.attention_prefill(4096, mla=False) is not None
    # B200's GQA prefill in SGLang's table claims more than the roofline at long prompts: left out, and TensorRT-LLM's
    # table (physical: 0.27 at 2K, 0.46 at 8K, 0.52 from 16K) prices it since issue 37 round seven
    prefill = blackwell.attention_prefill(4096, mla=False)
    assert prefill is not None and 0.3 < prefill < 0.45 and blackwell.attention_prefill(32768, mla=False) == pytest.approx(0.52, abs=0.01)
    assert blackwell.attention_decode(64, 64, 4096, mla=False) is not None


def test_mla_decode_over_an_fp8_cache_is_priced_on_its_own_kernel() -> None:
    """TensorRT-LLM's FP8-cache MLA decode kernel (AIConfigurator's mla/trtllm table) on B200 takes 0.59x the bf16-cache
    time at 128 heads, 32 x 16K (0.076 against 0.129 ms per layer); its curve is against the FP8 math peak, and a decode
    step with an FP8 cache reads it."""
    b200 = curves_for("b200")
    assert b200 is not None and b200.fp8_cache_grid
    assert b200.attention_decode(128, 32, 16384, fp8_cache=True) != b200.attention_decode(128, 32, 16384)
    assert b200.attention_decode(64, 32, 16384, mla=False, fp8_cache=True) == b200.attention_decode(64, 32, 16384, mla=False)  # GQA: MLA only
    sys = load_catalogue().system("hgx-b200")
    cfg, fp8 = deepseek_v3(), Quantisation.named("fp8")

    def attention(quant: Quantisation) -> Component:
        sc = Scenario(cfg, quant, Layout(4, tp=1), Workload(context=16384, concurrency=4 * 32), sys, Efficiency.measured())
        return next(c for c in decode_step(sc).components if c.name == "mla_attention")

    bf16_cache, fp8_cache = attention(fp8), attention(with_dtypes(fp8, kv="fp8"))
    acc = sys.accelerator
    roof = max(fp8_cache.bytes / acc.hbm_bw, fp8_cache.flops / acc.flops("fp8"))
    eff = b200.attention_decode(128, 32, 16384, fp8_cache=True)
    assert eff is not None and fp8_cache.time_s == pytest.approx(roof / eff)
    assert 0.5 < fp8_cache.time_s / bf16_cache.time_s < 0.7
