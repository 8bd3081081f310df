"""fla's real fused_recurrent_kda kernel (not a fake) behind openk3's seam, on CPU under Triton's interpreter: the
"kda_prefill" entry "fla_recurrent" against openk3's recurrence, and the model's prefill and decode steps on it against
its CPU ops. This is the check that openk3 hands the installed fla what fla means: the keywords, the V-first state
layout, the packed sequences.

fla stays off this process's path (installed, it makes transformers' kimi_linear, the HF parity oracle, call fla's
kernels on CPU tensors): `make test` installs fla-core into .venv/fla-site, and tests/ops/fla_interpreted.py runs in a
subprocess with it on PYTHONPATH and TRITON_INTERPRET=1. fla's chunk_kda is not run here: under the interpreter its
autotuner needs a GPU driver and one of its kernels calls `.to` on a loop counter, which only compiled Triton allows;
benchmarks/gpu/run.sh runs it on a GPU (and tests/ops/test_kda_fla.py runs the seam with a fake of it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from openk3.ops.triton import triton_available

from .conftest import fla_interpreter_env, needs_fla_site

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not triton_available(), reason="triton is not installed (the gpu extra)"),
    needs_fla_site,
]


def run(mode: str) -> dict[str, Any]:
    env = fla_interpreter_env()
    result = subprocess.run([sys.executable, str(REPO / "tests" / "ops" / "fla_interpreted.py"), mode], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    out: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return out


def test_the_fla_recurrent_entry_equals_openk3s_recurrence() -> None:
    results = run("ops")
    assert len(results) == 4
    for case, errors in results.items():
        assert errors["output"] < 1e-5 and errors["state"] < 1e-5, (case, errors)


def test_the_model_on_flas_kernel_gives_its_cpu_logits() -> None:
    """Prefill (three packed prompts on dirty slots) and two decode steps, every KDA layer on fla's fused recurrence;
    and the prefill on the CPU ops with the decode steps on fla: the states in the slot pools mean the same to both."""
    result = run("model")
    tolerance = 1e-4 * max(1.0, result["logit_scale"])
    for key in ("max_abs_logit_diff", "max_abs_logit_diff_resumed"):
        assert len(result[key]) == 3 and max(result[key]) < tolerance, (key, result[key])
    assert result["kernels"] == {"fused_recurrent_kda": 3 * 3 + 3 * 2}  # 3 KDA layers x (prefill + 2 decode steps, 2 decode steps)
    decode_calls = result["calls"][3:]
    assert all(tokens == sequences == 3 for _, tokens, sequences in decode_calls), decode_calls  # one token per sequence
