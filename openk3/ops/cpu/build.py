"""Compile a C source shipped in this package into a shared library once per machine, and load it with ctypes.

Why: a decode step at serving batch sizes is a chain of a hundred small torch ops per layer whose dispatch costs more than
their arithmetic. A few plain C loops over the same tensors do the work of such a chain in one call. Plain C with no torch
headers compiles in about a second (a torch C++ extension takes about a minute) and needs only `cc`.

The library is cached under $OPENK3_CACHE_DIR (default ~/.cache/openk3)/kernels, keyed by a hash of the source, the headers,
the flags, the compiler's version and the CPU's flags, and written atomically, so concurrent first uses (several test
workers, EP ranks) are safe. OPENK3_CPU_MARCH overrides `-march=native` (FLAGS). No compiler, a failed build, no
writable cache or OPENK3_CPU_KERNELS=0: `load` returns None
(with a warning when a build was attempted), `kernels_available()` is False and the op registry offers no "c" backend:
every op is then resolved to its torch entries, once, when a model is built or prepared (ops/registry.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import warnings
from functools import cache
from pathlib import Path
from typing import Any

import torch  # noqa: F401  # loaded first, so that its OpenMP runtime is the one in the process (_openmp_flags)

# -march=native: the library is built on the machine that runs it (the cache key includes the machine's CPU flags).
# No -ffast-math: results stay within fp32 rounding of the torch reference. -ffp-contract=fast lets a * b + c become one
# fused multiply-add (one rounding instead of two; -std=c11 would otherwise forbid it), which the matmul loops of
# rows_gemm.h need to reach the FMA units. -fopenmp-simd honours `omp simd` pragmas (a
# reduction the compiler may then vectorise) without an OpenMP runtime; _openmp_flags adds -fopenmp only where torch's own
# runtime is already in the process.
# OPENK3_CPU_MARCH picks another -march (e.g. x86-64-v3: AVX2 + FMA without AVX-512): the kernels' portable paths, which a
# machine without AVX-512 runs, can then be built and tested on one that has it (tests/ops/test_portable_kernels.py).
FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp-simd", "-shared", "-fPIC", "-std=c11"]


def build_flags() -> list[str]:
    """The compiler flags of this process's kernel libraries (FLAGS with OPENK3_CPU_MARCH's -march, and OpenMP's)."""
    march = os.environ.get("OPENK3_CPU_MARCH", "native")
    if not march or any(c.isspace() for c in march):
        raise ValueError(f"OPENK3_CPU_MARCH={march!r}: expected one -march value such as native or x86-64-v3")
    return [f"-march={march}" if f == "-march=native" else f for f in FLAGS] + _openmp_flags()


def _cache_dir() -> Path:
    root = os.environ.get("OPENK3_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "openk3") / "kernels"  # home raises RuntimeError if unknown


def _openmp_flags() -> list[str]:
    """-fopenmp when torch's own libgomp is loaded in this process: the library then links to that same runtime (the loader
    reuses an object already loaded under the soname libgomp.so.1), so its parallel loops run on torch's threads. With
    another OpenMP runtime (or none) the kernels are built serial rather than bring a second runtime into the process."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return ["-fopenmp"] if "libgomp" in maps else []


def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


# every library the "c" backend's entries call
SOURCES = ("norm.c", "linear.c", "moe.c", "mla_decode.c", "kda_decode.c", "kda_chunk.c", "mxfp4.c", "attn_res.c", "glu.c", "argmax.c")


@cache
def kernels_available() -> bool:
    """Every kernel library builds and loads here (built on first call): the op registry's "c" backend exists."""
    return all(load(source) is not None for source in SOURCES)


def kernel(source_name: str, function: str, argtypes: list[Any], restype: Any) -> Any:
    """`bind`, for an entry of the "c" backend, which the registry only offers where every library loads: a missing one
    here is a broken install (a library deleted under a running process), not a case to work around."""
    fn = bind(source_name, function, argtypes, restype)
    if fn is None:
        raise RuntimeError(f"the C kernel {source_name}:{function} is not available, though kernels_available() said it was")
    return fn


def bind(source_name: str, function: str, argtypes: list[Any], restype: Any) -> Any:
    """`function` of the library built from `source_name`, typed for ctypes (the CDLL keeps the typed object, so later
    lookups of the same name see the types), or None when the library cannot be had."""
    lib = load(source_name)
    if lib is None:
        return None
    fn = getattr(lib, function)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


@cache
def load(source_name: str) -> ctypes.CDLL | None:
    """The compiled library of `openk3/ops/cpu/<source_name>`, or None when kernels are off or cannot be built."""
    if os.environ.get("OPENK3_CPU_KERNELS", "1") == "0":
        return None
    compiler = shlex.split(os.environ["CC"]) if os.environ.get("CC") else [shutil.which("cc") or shutil.which("gcc") or shutil.which("clang") or ""]
    if not compiler or not compiler[0]:
        return None
    here = Path(__file__).parent
    source = (here / source_name).read_text()
    headers = "".join(h.read_text() for h in sorted(here.glob("*.h")))  # what the source may include
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        flags = build_flags()
        key = hashlib.sha256("\0".join([source, headers, " ".join(flags), version, _cpu_flags()]).encode()).hexdigest()[:16]
        target = _cache_dir() / f"{Path(source_name).stem}-{key}.so"
        if target.exists():
            try:
                return ctypes.CDLL(str(target))
            except OSError:  # a damaged cache entry: build it again below
                target.unlink(missing_ok=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            src = Path(tmp) / source_name
            src.write_text(source)
            cmd = [*compiler, *flags, f"-I{here}", "-o", str(built), str(src), "-lm"]
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
            os.replace(built, target)  # atomic: a concurrent build of the same key writes the same bytes
        return ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", "") or str(err)
        warnings.warn(f"openk3: could not build or load the CPU kernel {source_name} ({detail.strip()[:300]}); using the torch path", stacklevel=2)
        return None
