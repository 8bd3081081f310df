"""The C kernels' portable paths (no AVX-512: what a machine with AVX2 only, most AMD Zen 2/3 and older Intel servers,
builds), run on this machine: the kernel tests that compare each C op with its torch reference pass with the libraries
built for x86-64-v3 (OPENK3_CPU_MARCH) in a fresh cache, and those libraries hold no AVX-512 instruction while the native
build here does (so the test can tell the two builds apart: it fails if the override were ignored)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from openk3.ops.cpu.build import _cpu_flags, build_flags

KERNEL_TESTS = (
    "tests/ops/test_linear.py",
    "tests/ops/test_linear_panels.py",
    "tests/ops/test_norm.py",
    "tests/ops/test_glu_c.py",
    "tests/ops/test_attn_res_c.py",
    "tests/ops/test_kda_chunk_c.py",
    "tests/ops/test_kda_decode_fused.py",
    "tests/ops/test_mxfp4_c.py",
    "tests/ops/test_moe_packed_c.py",
)
ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or not {"avx2", "fma"} <= set(_cpu_flags().split()) or shutil.which("objdump") is None,
    reason="an x86-64 machine with AVX2 and FMA, and objdump, to build and inspect the x86-64-v3 kernels",
)


def _env(cache: Path, march: str) -> dict[str, str]:
    return os.environ | {"OPENK3_CPU_MARCH": march, "OPENK3_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}


def _built_libraries(cache: Path, march: str) -> list[Path]:
    code = "from openk3.ops.cpu.build import kernels_available; assert kernels_available()"
    subprocess.run([sys.executable, "-c", code], env=_env(cache, march), check=True, cwd=ROOT, timeout=600)
    return sorted((cache / "kernels").glob("*.so"))


def _uses_avx512(lib: Path) -> bool:
    return "zmm" in subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True, check=True).stdout


def test_the_march_override_reaches_the_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENK3_CPU_MARCH", "x86-64-v3")
    assert "-march=x86-64-v3" in build_flags() and "-march=native" not in build_flags()
    monkeypatch.setenv("OPENK3_CPU_MARCH", "x86-64-v3 -O0")
    with pytest.raises(ValueError, match="expected one -march value"):
        build_flags()


def test_the_portable_build_has_no_avx512_and_passes_the_kernel_tests(tmp_path: Path) -> None:
    portable = _built_libraries(tmp_path / "v3", "x86-64-v3")
    assert portable and not any(_uses_avx512(lib) for lib in portable)
    if "avx512f" in _cpu_flags().split():  # here the native build takes the AVX-512 paths, so the two builds differ
        assert any(_uses_avx512(lib) for lib in _built_libraries(tmp_path / "native", "native"))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *KERNEL_TESTS]
    run = subprocess.run(cmd, env=_env(tmp_path / "v3", "x86-64-v3"), cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout.splitlines()[-1], run.stdout[-500:]
