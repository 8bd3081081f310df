"""`openk3 plan` through `register(subparsers)`, as the top-level CLI will wire it."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from openk3.planner.cli import build_request, main, register
from openk3.planner.overheads import Overheads
from openk3.planner.perf import Efficiency

FAST = ["--max-accelerators", "72"]


def test_register_adds_plan_with_run() -> None:
    parser = argparse.ArgumentParser(prog="openk3")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", "--model", "k3", "--hardware", "gb300-nvl72", "--context", "32k"])
    assert args.func.__name__ == "run" and args.context == "32k"


def test_text_report(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--model", "k3", "--hardware", "gb300-nvl72", "--context", "32k", "--concurrency", "4608", "--accelerators", "72", "--tp", "1", *FAST])
    out = capsys.readouterr().out
    assert rc == 0
    assert "checkpoint 1,559.9 GB" in out and "27,648 B/token" in out
    assert "decode step" in out and "binding:" in out and "offload tiers" in out


def test_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "plan",
            "--model",
            "k3",
            "--hardware",
            "gb300-nvl72",
            "--context",
            "32k",
            "--concurrency",
            "4608",
            "--accelerators",
            "72",
            "--tp",
            "1",
            "--json",
            "--ideal",
            *FAST,
        ]
    )
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert doc["cache"]["mla_bytes_per_token"] == 27_648
    assert doc["min_accelerators"]["weights"] == 8  # 7 would need TP7, which does not divide the 96 heads
    assert abs(doc["metrics"]["per_user_tok_s"] - 32) < 1.6
    assert doc["metrics"]["binding"] == "HBM bandwidth"


def test_user_errors_are_messages_not_tracebacks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--hardware", "tpu-v9", *FAST]) == 2
    assert "unknown hardware 'tpu-v9'" in capsys.readouterr().err
    assert main(["plan", "--context", "lots", *FAST]) == 2
    assert "token count 'lots'" in capsys.readouterr().err


def test_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "plan.png"
    rc = main(["plan", "--context", "8k", "--accelerators", "72", "--tp", "1", "--plot", str(png), *FAST])
    if importlib.util.find_spec("matplotlib") is None:
        assert rc == 2 and "pip install 'openk3[plot]'" in capsys.readouterr().err
    else:
        assert rc == 0 and png.read_bytes()[:4] == b"\x89PNG"


def test_kernels_default_to_measured_and_flat_stays_selectable() -> None:
    """Issue 37 round five: measured kernels are the default; `--kernels flat` is the old model whole (no host gap);
    `--ideal` is the roofline, and `--ideal --kernels measured` says it contradicts itself."""
    parser = argparse.ArgumentParser(prog="openk3")
    register(parser.add_subparsers(dest="command"))
    base = ["plan", "--model", "k3", "--hardware", "gb300-nvl72", "--context", "8k"]
    assert build_request(parser.parse_args(base)).efficiency == Efficiency.measured()
    assert build_request(parser.parse_args([*base, "--kernels", "flat"])).efficiency == Efficiency.flat()
    assert build_request(parser.parse_args([*base, "--ideal"])).efficiency == Efficiency.ideal()
    tuned = build_request(parser.parse_args([*base, "--kernels", "flat", "--eff-gemm", "0.4"])).efficiency
    assert tuned.gemm == 0.4 and tuned.step_overheads == Overheads.none()
    with pytest.raises(ValueError, match="contradict"):
        build_request(parser.parse_args([*base, "--ideal", "--kernels", "measured"]))


def test_report_names_the_kernel_model(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--context", "8k", "--accelerators", "72", "--tp", "1", *FAST]
    assert main(args) == 0
    assert "inputs: kernels measured (2 ms + 20 us/sequence host gap per step)" in capsys.readouterr().out
    assert main([*args, "--kernels", "flat"]) == 0
    assert "inputs: kernels flat, efficiency hbm 0.8" in capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    eff = json.loads(capsys.readouterr().out)["inputs"]["efficiency"]
    assert eff["kernels"] == "measured" and eff["overheads"]["host_gap_s"] == 2e-3
