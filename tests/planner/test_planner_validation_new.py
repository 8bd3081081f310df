"""The second held-out set (issue 37 item 1): cited, disjoint from the runs the model was tuned on, every row predicted."""

from __future__ import annotations

import re

import pytest

from openk3.planner.bench_setup import PERF_OVERVIEW_REQUESTS, Counting
from openk3.planner.inputs import Balance
from openk3.planner.models import qwen3_30b_a3b, qwen3_235b
from openk3.planner.perf import Efficiency
from openk3.planner.validation import CASES, Phase, Split
from openk3.planner.validation_agg import AGGREGATED_CASES, BLOG_CASES, QWEN_FP4, QWEN_FP8, aggregated_tok_s_per_gpu
from openk3.planner.validation_new import NEW_HELD_OUT_CASES


def test_every_row_cites_a_commit_and_is_predicted() -> None:
    assert len(NEW_HELD_OUT_CASES) >= 40
    for c in NEW_HELD_OUT_CASES:
        assert c.split == Split.NEW_HELD_OUT and c.phase == Phase.AGGREGATED
        assert re.search(r"github\.com/NVIDIA/TensorRT-LLM/blob/[0-9a-f]{12}/docs/.+\.md, section '", c.source), c.source
        for eff in (Efficiency(), Efficiency.flat()):
            p = c.predict(eff)
            assert p is not None and p > 0


def test_no_row_repeats_a_tuned_or_earlier_held_out_run() -> None:
    """A run is (model, accelerator, layout, lengths); the new set shares none with the first sets."""
    earlier = {c.name for c in CASES + AGGREGATED_CASES + BLOG_CASES}
    new = [c.name for c in NEW_HELD_OUT_CASES]
    assert len(set(new)) == len(new)
    assert not earlier & set(new)
    tuned_runs = {c.name.rsplit(",", 1)[0] for c in AGGREGATED_CASES if c.split == Split.TUNED}
    assert not tuned_runs & {n.rsplit(",", 1)[0] for n in new}


def test_qwen3_30b_counts_match_published() -> None:
    """Qwen3-30B-A3B: 30.5B total, 3.3B activated (model card); the planner's active count leaves out the input embedding."""
    cfg = qwen3_30b_a3b()
    pc = cfg.param_count()
    assert pc.total == pytest.approx(30.5e9, rel=0.01)
    assert pc.active + cfg.vocab_size * cfg.hidden_size == pytest.approx(3.3e9, rel=0.02)  # 3.35B: "3.3B" at two figures


def test_set_up_follows_the_published_runs() -> None:
    """Round four: the Qwen3 checkpoints' own FP8 KV cache, experts unbalanced (no load balancer in the runs' options),
    and the page's request count served to the last (a run of one batch is slower than the steady state)."""
    assert QWEN_FP4.cache_dtype_bytes == 1 and QWEN_FP8.cache_dtype_bytes == 1
    m = Efficiency.measured()
    args = (qwen3_30b_a3b(), QWEN_FP4, 1, "hgx-b200", 2048, 128, m)
    steady = aggregated_tok_s_per_gpu(*args, bench=Counting.PER_INSTANCE)
    run = aggregated_tok_s_per_gpu(*args, bench=Counting.PER_INSTANCE, requests=PERF_OVERVIEW_REQUESTS[(2048, 128)])
    assert run < steady
    case = next(c for c in NEW_HELD_OUT_CASES if c.name == "Qwen3-30B-A3B, B200 TP1 (FP4), v1.0, 2048/128")
    assert case.predict(m) == pytest.approx(run)
    dep8 = (qwen3_235b(), QWEN_FP4, 8, "hgx-b200", 2048, 128, m)
    unbalanced = aggregated_tok_s_per_gpu(*dep8, bench=Counting.PER_INSTANCE)
    assert unbalanced < aggregated_tok_s_per_gpu(*dep8, bench=Counting.PER_INSTANCE, balance=Balance.EPLB)
