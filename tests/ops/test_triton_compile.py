"""benchmarks/gpu/compile_check.py: every Triton kernel openk3 launches compiles with Triton's real NVIDIA backend for
Hopper (sm_90) and Blackwell (sm_100) at K3's widths, in the dtypes the GPU runs (bf16 products, which the interpreter
never builds), and fits the target's shared memory; and the check itself fails on a launch that would not fit or not
compile. No GPU is needed: Triton compiles for a named target and ptxas ships with it. Each run is a subprocess without
TRITON_INTERPRET (this suite's conftest sets it, and under it triton.jit compiles nothing)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from openk3.ops.triton import triton_available

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton is not installed (the gpu extra)")]

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "benchmarks" / "gpu" / "compile_check.py"


def run_python(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compiled here, not read from an earlier run's cache
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "benchmarks" / "gpu"), str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def launched_kernels() -> set[str]:
    """The kernels the package launches: every `name[grid](` in openk3/ops/triton (jit helpers called inside them excluded)."""
    return {name for path in (REPO / "openk3" / "ops" / "triton").glob("*.py") for name in re.findall(r"(\w+)\[grid\]\(", path.read_text())}


def table_rows(text: str, arch: int) -> list[list[str]]:
    section = text.split(f"### sm_{arch} ")[1].split("### ")[0]
    return [[cell.strip() for cell in line.split("|")[1:-1]] for line in section.splitlines() if line.startswith("| ") and not line.startswith("| wrapper")]


def test_every_kernel_compiles_for_hopper_and_blackwell(tmp_path: Path) -> None:
    result = run_python([str(CHECK), "--arch", "90", "--arch", "100", "--out", str(tmp_path)], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    text = (tmp_path / "gpu_compile.md").read_text()
    kernels = launched_kernels()
    assert kernels == {"_latent_decode_kernel", "_latent_prefill_kernel", "_grouped_mxfp4_gemm", "_dequantize_kernel"}
    for arch in (90, 100):
        rows = table_rows(text, arch)
        for dtype in ("bfloat16", "float32"):
            compiled = {row[1].split(" ")[0] for row in rows if dtype in row[0]}
            assert compiled == kernels, f"sm_{arch} {dtype}: compiled {compiled}"
        for case, kernel, warps, registers, shared, spills, check in rows:
            assert check == "ok", (arch, case, kernel, check)
            assert 0 < int(registers) <= 255 and 0 < int(shared) <= 232448 and int(warps) > 0
            assert spills == "none", (arch, case, spills)  # at K3's widths no launch spills (float32 MLA tiles are halved for it)


def test_a_launch_over_the_shared_memory_limit_fails_the_check(tmp_path: Path) -> None:
    """512 key rows per tile: the MLA decode kernel's bf16 tiles need more than sm_90's 227 KiB of shared memory."""
    code = (
        "import sys, compile_check, openk3.ops.triton.mla_decode as m; m.BLOCK_S = 512; sys.exit(compile_check.main(['--arch', '90', '--dtype', 'bfloat16']))"
    )
    result = run_python(["-c", code], tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    rows = table_rows(result.stdout, 90)
    decode = next(row for row in rows if row[1] == "_latent_decode_kernel")
    assert decode[-1].startswith("FAIL: needs") and "shared memory per block, sm_90 has 232448" in decode[-1]
    assert all(row[-1] == "ok" for row in rows if row is not decode)
    assert "1 launch(es) failed" in result.stderr


def test_a_kernel_that_does_not_compile_is_a_failed_launch(tmp_path: Path) -> None:
    """A wrong kernel is caught at the launch that compiles it, and the next case still runs."""
    (tmp_path / "bad_kernel.py").write_text(
        textwrap.dedent(
            """
            import triton
            import triton.language as tl

            @triton.jit
            def bad(x_ptr):
                tl.store(x_ptr + tl.arange(0, 3), 1.0)  # a range must have a power-of-two length
            """
        )
    )
    code = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {str(tmp_path)!r})
        import compile_check, bad_kernel
        from openk3.ops.triton.mxfp4_decode import dequantize_triton
        codes, scales = torch.zeros(4, 16, dtype=torch.uint8), torch.full((4, 1), 127, dtype=torch.uint8)
        with compile_check.Recorder(90) as recorder:
            recorder.call("bad", bad_kernel.bad[(1,)], torch.zeros(4))
            recorder.call("dequantise", dequantize_triton, codes, scales, torch.bfloat16)
        for launch in recorder.launches:
            print(launch.case, "|", launch.fails(90))
        from triton.runtime.jit import JITFunction
        try:  # everything the recorder replaced is back: a CPU tensor is refused again, and launches run, not compile
            dequantize_triton(codes, scales, torch.bfloat16)
        except RuntimeError as e:
            print("restored |", "needs its tensors on one CUDA device" in str(e), JITFunction.run.__name__)
        """
    )
    result = run_python(["-c", code], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("bad | ") and "None" not in lines[0] and "arange" in lines[0], lines
    assert lines[1] == "dequantise | None", lines
    assert lines[2] == "restored | True run", lines
