"""benchmarks/gpu/driver.py (what benchmarks/gpu/run.sh runs on a GPU) in its dry-run mode: the same kernels, checks,
table and engine rows at tiny shapes on CPU under TRITON_INTERPRET=1, so the script is known to run before device time
is spent on it; and a bench that raises costs its own row only."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from openk3.ops.triton import triton_available

from .conftest import fla_interpreter_env, needs_fla_site

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton is not installed (the gpu extra)")]

REPO = Path(__file__).resolve().parents[2]
DRIVER = REPO / "benchmarks" / "gpu" / "driver.py"


def load_driver(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_driver", DRIVER)
    assert spec is not None and spec.loader is not None
    driver = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_driver", driver)  # dataclasses look their module up while the file runs
    spec.loader.exec_module(driver)
    return driver


def table_rows(table: str) -> dict[str, str]:
    return {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ") and "|---" not in line}


def test_dry_run_writes_the_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver = load_driver(monkeypatch)
    assert driver.main(["--dry-run", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "gpu.md").read_text()
    assert "DRY RUN" in table and "Incomplete" not in table
    rows = table_rows(table)
    for name in (
        "MoE experts: MXFP4 Triton vs bf16 grouped matmul",
        "MLA decode latent attention: Triton vs torch (gathered pages)",
        "MLA decode attention: absorbed Triton vs expanded K/V + SDPA",
        "MLA prefill chunk: Triton latent vs expanded K/V + SDPA",
        "K3 slice (KDA + MLA layer, 896 MXFP4 experts), prefill chunk: kernels vs torch forms",
        "K3 slice (KDA + MLA layer, 896 MXFP4 experts), decode step: kernels vs torch forms",
    ):
        assert "| ok |" in rows[name], name
    assert "skipped" in rows["KDA prefill: fla chunk_kda vs openk3 chunk (torch)"]
    kda_decode = rows["KDA decode: fla fused_recurrent_kda (seam) vs openk3 torch step"]
    assert ("skipped" if importlib.util.find_spec("fla") is None else "| ok |") in kda_decode  # fla runs under the interpreter when installed
    assert "x |" not in table  # no ratio is printed from interpreter timings
    assert {"1", "2"} <= set(rows)  # the engine rows, batch 1 and 2


def test_a_bench_that_raises_fails_its_row_and_the_run_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver = load_driver(monkeypatch)

    def broken(*args: object) -> None:
        raise RuntimeError("out of resources: shared memory")

    monkeypatch.setattr(driver, "bench_mla", broken)
    monkeypatch.setattr(driver, "engine_row", lambda batch, device, dry_run: f"| {batch} | - | - | - | - |")
    assert driver.main(["--dry-run", "--out", str(tmp_path)]) == 1
    rows = table_rows((tmp_path / "gpu.md").read_text())
    assert "FAIL (RuntimeError: out of resources: shared memory)" in rows["MLA decode"]
    assert rows["1"] == "| 1 | - | - | - | - |"
    assert "| ok |" in rows["MLA prefill chunk: Triton latent vs expanded K/V + SDPA"]  # the rows after it still ran
    assert "| ok |" in rows["K3 slice (KDA + MLA layer, 896 MXFP4 experts), decode step: kernels vs torch forms"]


def test_a_stopped_run_leaves_the_rows_it_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu.md is rewritten after every bench: a run stopped during the engine rows keeps the kernel rows (`timeout` kills
    the process, which runs no handler; an exception no bench guard catches stands in for it here)."""
    driver = load_driver(monkeypatch)

    def killed(*args: object) -> str:
        raise KeyboardInterrupt  # not an Exception: nothing in the driver catches it

    monkeypatch.setattr(driver, "engine_row", killed)
    with pytest.raises(KeyboardInterrupt):
        driver.main(["--dry-run", "--out", str(tmp_path)])
    table = (tmp_path / "gpu.md").read_text()
    assert "**Incomplete" in table and "| ok |" in table_rows(table)["MoE experts: MXFP4 Triton vs bf16 grouped matmul"]


@needs_fla_site
def test_dry_run_with_fla_checks_the_kda_decode_rows(tmp_path: Path) -> None:
    """With fla importable, the KDA decode rows run fla's fused recurrence (under the interpreter) against openk3's step."""
    env = fla_interpreter_env()
    result = subprocess.run([sys.executable, str(DRIVER), "--dry-run", "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = table_rows((tmp_path / "gpu.md").read_text())
    assert "| ok |" in rows["KDA decode: fla fused_recurrent_kda (seam) vs openk3 torch step"]
    assert "| ok |" in rows["KDA decode: fla on K-first states vs the seam (its V-first conversions and checks)"]


def test_an_isolated_bench_whose_process_dies_fails_its_row_only(tmp_path: Path) -> None:
    """On CUDA each bench runs in a process of its own: a fault that kills it (here an injected abort, as an illegal address
    can end a CUDA process) fails that bench's row, and the next bench runs in a fresh process."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OPENK3_DRIVER_ABORT": "MLA decode"}
    benches = "MoE experts,MLA decode,MLA prefill,engine batch 1"
    cmd = [sys.executable, str(DRIVER), "--dry-run", "--isolate", "--benches", benches, "--out", str(tmp_path)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    rows = table_rows((tmp_path / "gpu.md").read_text())
    assert "FAIL (its process ended with" in rows["MLA decode"] and "before reporting" in rows["MLA decode"]
    assert "| ok |" in rows["MoE experts: MXFP4 Triton vs bf16 grouped matmul"]
    assert "| ok |" in rows["MLA prefill chunk: Triton latent vs expanded K/V + SDPA"]
    assert rows["1"].startswith("| 1 | (dry run) |")
    assert "driver.py: MLA prefill:" in result.stdout  # each bench's wall time, for sizing the next run


def test_an_unknown_bench_name_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    driver = load_driver(monkeypatch)
    with pytest.raises(SystemExit):
        driver.main(["--dry-run", "--benches", "MLA decode,flash attention", "--out", str(tmp_path)])
