"""The replicas run in Ray worker processes with another working directory: the path flags they are given are made
absolute first, against the caller's (a preset name for --model is left alone)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="ray[serve] is not installed (the `ray` extra)")

from openk3.launch.replicas import with_absolute_paths  # noqa: E402
from openk3.launch.serve_flags import parse_serve_arguments as serve_arguments  # noqa: E402


def test_relative_path_flags_become_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "template.jinja").write_text("{{ messages }}")
    monkeypatch.chdir(tmp_path)
    argv = ["--model", "ckpt", "--chat-template", "template.jinja", "--eplb-stats", "load.json", "--disk-offload-dir", "tier"]
    args = with_absolute_paths(serve_arguments(argv))
    assert args.model == str(tmp_path / "ckpt")
    assert Path(args.chat_template) == tmp_path / "template.jinja"
    assert args.eplb_stats == str(tmp_path / "load.json")  # made absolute whether or not it exists yet
    assert args.disk_offload_dir == str(tmp_path / "tier")
    assert os.path.isabs(args.model)


def test_a_preset_name_and_absolute_paths_stay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    args = with_absolute_paths(serve_arguments(["--model", "tiny", "--eplb-stats", str(tmp_path / "x.json")]))
    assert args.model == "tiny" and args.eplb_stats == str(tmp_path / "x.json")
