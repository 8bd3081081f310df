"""The launcher also works under torchrun (env:// rendezvous): the debug model with each EP method equals the local forward."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_two_ranks() -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this Python")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "tests.parallel.torchrun_main"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in rows) == [0, 1] and {r["backend"] for r in rows} == {"gloo"}
    for row in rows:
        for name in ("ep", "eplb", "moonep", "replicated_ep", "replicated_eplb", "replicated_moonep"):
            assert row["errors"][name] <= 1e-5, (row["rank"], name)
