"""Validation cases (issue 20): tuned-on cases kept apart from held-out ones, every prediction computed from the
shipped defaults, and no published figure invented where none was found."""

from __future__ import annotations

import pytest

from openk3.planner.overheads import Overheads, sglang_graph_sizes
from openk3.planner.perf import Efficiency
from openk3.planner.validation import CASES, Phase, Split

BY_NAME = {c.name: c for c in CASES}

# (low, high) error bands the docs report for each case with a prediction: a change to the model that moves a case out
# of its band must update docs/planner.md too. Held-out decode within +-15% is the goal; the others are outside
# it for the reason each case states, and the band pins the direction of that miss. The default model is the measured
# kernels (issue 37 round five); test_flat_model_keeps_its_bands pins the flat factors' errors the docs quote beside it.
BANDS = {
    "Kimi K2, 96 decode H200, EP96 + 96 redundant": (-0.30, 0.0),
    "DeepSeek-V3, GB200 NVL72, EP48 (part I)": (-0.05, 0.10),  # round eight: its script's graph at 768, not 1,024
    "DeepEP LL dispatch, EP8": (-0.25, 0.0),
    "DeepEP LL combine, EP64": (0.0, 0.25),
    "DeepSeek-V3, GB200 NVL72 decode, BF16 attn + FP8 MoE": (-0.25, 0.0),
    "DeepSeek-V3, GB200 NVL72 decode, FP8 attn + NVFP4 MoE": (-0.15, 0.0),  # round eight: the post's 1,408 per rank
    "DeepSeek-V3, GB200 NVL72 prefill, BF16 attn + FP8 MoE": (-0.35, 0.0),
    "DeepSeek-V3, GB200 NVL72 prefill, FP8 attn + NVFP4 MoE": (-0.10, 0.10),
    "DeepSeek-V3, 72 decode H100 (9 nodes), EP72": (-0.05, 0.10),
    "DeepSeek-V3, 32 prefill H100 (4 nodes), EP32": (-0.10, 0.05),  # round eight: DeepEP normal, once per node over the NIC
    "DeepSeek-R1 NVFP4, GB300 NVL72, DEP8, 128K/8K": (-0.25, 0.0),  # round eight: per user (23 tok/s), not per GPU of P + D
    "DeepSeek-R1 NVFP4, 2 GB300, EP2, prefill only": (0.0, 0.40),
}


def test_both_splits_and_every_phase_are_present() -> None:
    assert {c.split for c in CASES} == {Split.TUNED, Split.HELD_OUT}  # the new held-out set is validation_new.py's
    held = [c for c in CASES if c.split == Split.HELD_OUT]
    assert {c.phase for c in held} >= {Phase.DECODE, Phase.PREFILL}
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name", sorted(BANDS))
def test_error_band(name: str) -> None:
    c = BY_NAME[name]
    err = c.error()
    assert err is not None
    low, high = BANDS[name]
    assert low <= err <= high, f"{name}: {err:+.1%} outside [{low:+.0%}, {high:+.0%}]"


def test_missing_figures_are_said_not_invented() -> None:
    for c in CASES:
        assert c.source
        if c.predictor is None:
            assert c.note.startswith("no prediction") or c.published is None
            assert c.predict() is None and c.error() is None
        if c.published is None:
            assert "not found in the offline corpus" in c.source + c.note
        if c.name not in BANDS:
            assert c.error() is None  # every case with an error has a band above


def test_predictions_follow_the_inputs() -> None:
    """Not constants: FP8 attention and NVFP4 experts make the same GB200 decode faster in the model."""
    bf16 = BY_NAME["DeepSeek-V3, GB200 NVL72 decode, BF16 attn + FP8 MoE"].predict()
    fp8 = BY_NAME["DeepSeek-V3, GB200 NVL72 decode, FP8 attn + NVFP4 MoE"].predict()
    assert bf16 is not None and fp8 is not None and fp8 > 1.3 * bf16


FLAT_BANDS = {  # the flat factors' errors, quoted in the cases' notes and in docs/planner.md's anchors
    "DeepSeek-V3, GB200 NVL72, EP48 (part I)": (0.50, 0.60),
    "DeepSeek-V3, GB200 NVL72 decode, BF16 attn + FP8 MoE": (0.25, 0.35),
    "DeepSeek-V3, 72 decode H100 (9 nodes), EP72": (0.05, 0.15),
}


def test_flat_model_keeps_its_bands() -> None:
    flat = Efficiency.flat()
    for name, (low, high) in FLAT_BANDS.items():
        err = BY_NAME[name].error(flat)
        assert err is not None and low <= err <= high, f"{name}: flat {err}"


def test_sglang_runs_pad_to_sglang_graphs() -> None:
    """SGLang's default decode graphs (server_args.py): every 8 up to 256, every 16 to 496, every 32 from 512, and the
    max batch itself; the validation's SGLang rows pad to them (or to their scripts' --cuda-graph-bs), not to
    TensorRT-LLM's powers of two."""
    sizes = sglang_graph_sizes()
    assert sizes[:6] == (1, 2, 4, 8, 12, 16) and 40 in sizes and 64 in sizes and 272 in sizes and sizes[-1] == 512
    assert Overheads(graph_sizes=sizes).padded_batch(36) == 40  # the GB300 128K row's 36 sequences per rank
    assert Overheads().padded_batch(36) == 64
    assert sglang_graph_sizes(300)[-2:] == (288, 300)  # the max batch is captured too
