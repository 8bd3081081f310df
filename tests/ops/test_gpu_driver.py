"""benchmarks/gpu/driver.py (what benchmarks/gpu/run.sh runs on a GPU) in its dry-run mode: the same kernels, checks,
table and engine rows at tiny shapes on CPU under TRITON_INTERPRET=1, so the script is known to run before device time
is spent on it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from openk3.ops.triton import triton_available

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton is not installed (the gpu extra)")]

DRIVER = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "driver.py"


def test_dry_run_writes_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("gpu_driver", DRIVER)
    assert spec is not None and spec.loader is not None
    driver = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_driver", driver)  # dataclasses look their module up while the file runs
    spec.loader.exec_module(driver)
    assert driver.main(["--dry-run", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "gpu.md").read_text()
    assert "DRY RUN" in table
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ") and "|---" not in line}
    assert "| ok |" in rows["MoE experts: MXFP4 Triton vs bf16 grouped matmul"]
    assert "| ok |" in rows["MLA decode latent attention: Triton vs torch (gathered pages)"]
    assert "skipped" in rows["KDA prefill: fla chunk_kda vs openk3 chunk (torch)"]
    assert "x |" not in table  # no ratio is printed from interpreter timings
    assert {"1", "2"} <= set(rows)  # the engine rows, batch 1 and 2
