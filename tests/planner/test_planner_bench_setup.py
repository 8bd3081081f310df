"""trtllm-bench's batch and token budget (bench_setup.py): its rounding rules and the run shape validation prices."""

from __future__ import annotations

import pytest

from openk3.planner.bench_setup import PERF_OVERVIEW_REQUESTS, BenchSettings, Counting, RunShape, bench_settings, run_shape


def test_rounding_rules() -> None:
    # below 256 requests: multiples of 32, at least 64; tokens at least 2,048
    assert bench_settings(10, 1000, 1000) == BenchSettings(64, 2048)
    assert bench_settings(200, 1000, 1000) == BenchSettings(224, 2048)  # 400 tokens -> the 2,048 floor
    # 256..1023: multiples of 128; 4,096..8,191 tokens: multiples of 512
    s = bench_settings(730, 1000, 1000)
    assert s.max_batch == 768 and s.max_tokens == 2048  # 1,460 tokens is under the floor
    s = bench_settings(600, 5000, 500)  # 6,600 tokens -> 13 x 512
    assert s.max_batch == 640 and s.max_tokens == 6656
    # caps: 4,096 requests, 32,768 tokens; above 1,024 multiples of 256, above 8,192 tokens multiples of 1,024
    assert bench_settings(5563, 128, 128) == BenchSettings(4096, 8192)
    assert bench_settings(1500, 20000, 2000) == BenchSettings(1536, 17408)  # 16,500 tokens -> 17 x 1,024
    assert bench_settings(3000, 20000, 2000).max_tokens == 32768
    with pytest.raises(ValueError, match="kv_requests"):
        bench_settings(0.5, 128, 128)


def test_run_shape_caps_the_batch_and_gives_the_step_budget() -> None:
    # one GPU that holds 5,563 requests of 256 tokens admits 4,096 of them (its max batch); 8,192 tokens per step
    assert run_shape(5563, 1, 128, 128, Counting.PER_RANK) == RunShape(4096, 4096, 8192)
    # a KV limit under the cap is the batch, the engine's max batch its rounding up (730 -> 768); 2,048 tokens per step,
    # shared by decode rows and prompt chunks
    assert run_shape(730, 1, 1000, 1000, Counting.PER_RANK) == RunShape(730, 768, 2048)
    # counted over an 8-rank instance (v1.0), batch and budget come from the instance's 1,600 requests but apply per rank
    assert run_shape(1600, 8, 2048, 128, Counting.PER_INSTANCE) == RunShape(1600, 1792, 27648)
    assert run_shape(1600, 8, 2048, 128, Counting.PER_RANK) == RunShape(1600, 224, 3584)  # 200 -> 224; 3,400 -> 3,584 tokens


def test_request_counts_cover_every_perf_overview_row() -> None:
    from openk3.planner.validation_agg import AGGREGATED_CASES
    from openk3.planner.validation_new import NEW_HELD_OUT_CASES

    for c in AGGREGATED_CASES + NEW_HELD_OUT_CASES:
        isl, osl = (int(x) for x in c.name.rsplit(" ", 1)[1].split("/"))
        assert (isl, osl) in PERF_OVERVIEW_REQUESTS, c.name
    assert PERF_OVERVIEW_REQUESTS[(2048, 128)] == 3000 and PERF_OVERVIEW_REQUESTS[(20000, 2000)] == 1000
