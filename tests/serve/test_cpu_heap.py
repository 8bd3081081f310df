"""serve/cpu_heap.py: the heap setting is applied once, can be declined, and really stops large blocks from being unmapped."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from openk3.serve import cpu_heap


def test_only_the_process_option_touches_the_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building an engine leaves the C library alone; `--cpu-heap system` (or OPENK3_CPU_HEAP=system) does too."""
    from openk3.cli import build_parser
    from openk3.serve.engine import EngineConfig, LLMEngine
    from openk3.serve.tokenizer import ByteTokenizer
    from tests.serve.serve_fakes import FakeModel

    cpu_heap.keep_heap_for_reuse.cache_clear()
    monkeypatch.setattr(cpu_heap, "_mallopt", lambda: pytest.fail("mallopt must not be called"))
    try:
        LLMEngine(FakeModel(), ByteTokenizer(256), EngineConfig(num_pages=8, page_size=4))
        assert cpu_heap.apply_heap_mode("system") is False
        with pytest.raises(ValueError, match="--cpu-heap 'fast' is invalid"):
            cpu_heap.apply_heap_mode("fast")
        monkeypatch.setenv("OPENK3_CPU_HEAP", "system")
        for command in ("serve", "generate --prompt x"):
            assert build_parser().parse_args(command.split()).cpu_heap == "system"
        monkeypatch.delenv("OPENK3_CPU_HEAP")
        assert build_parser().parse_args(["serve"]).cpu_heap == "keep"
    finally:
        cpu_heap.keep_heap_for_reuse.cache_clear()


@pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc", reason="glibc's mallopt")
def test_freed_large_blocks_stay_mapped_for_reuse() -> None:
    """In a fresh process: without the setting a freed 8 MiB block goes back to the kernel (its pages leave the resident set);
    with it the block stays in the heap. Read from /proc/self/statm, so this checks the effect, not just the call."""
    probe = """
import os, sys, ctypes
from openk3.serve.cpu_heap import keep_heap_for_reuse
if sys.argv[1] == "keep":
    assert keep_heap_for_reuse()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
page = os.sysconf("SC_PAGE_SIZE")
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * page
size = 8 << 20
p = libc.malloc(size)
ctypes.memset(p, 1, size)
before = resident()
libc.free(ctypes.c_void_p(p))
print(before - resident())
"""
    env = {k: v for k, v in os.environ.items() if k != "OPENK3_CPU_HEAP"}
    released = {mode: int(subprocess.check_output([sys.executable, "-c", probe, mode], text=True, env=env)) for mode in ("system", "keep")}
    assert released["system"] >= 6 << 20  # unmapped on free
    assert released["keep"] < 1 << 20  # kept for the next allocation
