"""Uninitialised memory made visible for every test of the ops, as fla's test suite does it.

torch.empty and its relatives hand back whatever the allocator had: on a fresh page that is zeros, so an op that reads an
element nobody wrote (a C kernel's output row it skipped, an accumulator it never cleared) passes by luck. Here every such
allocation comes back poisoned, so a read of an unwritten element changes the result:

- floating point (and complex) tensors are filled with NaN, which survives any arithmetic it enters;
- integer tensors are filled with -1 (all bits set: 255 in uint8, which is also E8M0's NaN scale for MXFP4), bool with True.
  -1 because the ids that feed the C kernels (slots, page ids, expert ids) are range-checked against 0 before a kernel
  dereferences them, so a poisoned id fails with an error, and an unchecked -1 used as an offset reads the element just
  before a buffer (wrong numbers) instead of the far-out-of-range address a large value would be (a segfault takes the whole
  test process down, where a wrong number fails one assertion).

The patches go through monkeypatch, so each test starts and ends with the real functions.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.utils._device import _device_constructors

# Triton reads TRITON_INTERPRET when a kernel is defined (openk3.ops.triton's modules are imported on first use, after
# this): without CUDA the kernels of the `triton`-marked tests run in its interpreter, on CPU tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "triton: runs Triton kernels (under TRITON_INTERPRET=1 without CUDA); skipped without triton")


# `with torch.device(...)` recognises the factory functions by identity, from a set torch builds once, on first use
# (torch.utils._device._device_constructors, cached). Built while these patches are in place, the set would hold the
# poisoned wrappers instead of torch.empty & co., and every later `with torch.device("meta")` in the session (the K3
# model built on meta, in tests/model) would allocate its empty tensors on the CPU: build it now, unpatched.
_device_constructors()

# The allocation entry points that return uninitialised memory; torch.empty, torch.empty_like and Tensor.new_empty are the
# ones openk3/ops calls, the others are poisoned so that a future use is covered too.
_TORCH_FUNCTIONS = ("empty", "empty_like", "empty_strided", "empty_permuted")
_TENSOR_METHODS = ("new_empty", "new_empty_strided")


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill a freshly allocated strided tensor with NaN (floating, complex), True (bool) or -1 (integers); returns it."""
    if t.layout is not torch.strided or t.numel() == 0:
        return t
    with torch.no_grad():  # a leaf made with requires_grad=True may not be written in place under autograd
        if t.dtype.is_floating_point or t.dtype.is_complex:
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.fill_(True)
        else:
            t.fill_(-1 if t.dtype.is_signed else torch.iinfo(t.dtype).max)
    return t


def _poisoning(allocate: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`allocate` with its result poisoned; arguments pass through untouched (sizes as varargs or a tuple, dtype, device,
    out, memory_format, requires_grad, ...), so every call form keeps working."""

    @functools.wraps(allocate)
    def poisoned(*args: object, **kwargs: object) -> torch.Tensor:
        return poison_(allocate(*args, **kwargs))

    return poisoned


@pytest.fixture(autouse=True)
def nan_poisoned_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _TORCH_FUNCTIONS:
        if hasattr(torch, name):
            monkeypatch.setattr(torch, name, _poisoning(getattr(torch, name)))
    for name in _TENSOR_METHODS:
        monkeypatch.setattr(torch.Tensor, name, _poisoning(getattr(torch.Tensor, name)))


# fla-core, installed beside the venv by `make test` (Makefile: importable in this process, it would break transformers'
# kimi_linear oracle), for the tests that run fla's kernels in a subprocess under Triton's interpreter
REPO = Path(__file__).resolve().parents[2]
FLA_SITE = Path(os.environ.get("OPENK3_FLA_SITE", REPO / ".venv" / "fla-site"))
needs_fla_site = pytest.mark.skipif(not (FLA_SITE / "fla").is_dir(), reason=f"fla-core is not installed in {FLA_SITE} (make test installs it there)")


def fla_interpreter_env() -> dict[str, str]:
    """A subprocess environment with fla and this checkout importable and Triton's interpreter on."""
    return {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(FLA_SITE), str(REPO)])}
