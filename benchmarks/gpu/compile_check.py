"""Every Triton kernel of openk3 compiled for a GPU target on a machine without a GPU, at K3's widths, with what each
launch would cost the multiprocessor: registers, shared memory and spills, one markdown table.

The interpreter (TRITON_INTERPRET=1) proves what the kernels compute, but not that they compile: it runs no layout pass,
no tensor-core lowering and no ptxas, and it multiplies 16-bit floats in fp32 (ops/triton/moe_mxfp4.dot_dtype), so the
bf16 products the GPU runs are never built. Here Triton's real NVIDIA backend builds them: a stand-in driver names the
target (Triton needs no GPU to compile, only to launch), the package's own wrappers are called on CPU tensors of K3's
widths so every launch is specialised exactly as on the GPU (dtypes, constexprs, 16-byte alignment), and each launch is
compiled and never run. Each cubin's resource use is read with the cuobjdump Triton ships. A launch fails the check when
it does not compile or needs more shared memory per block than the target has, which is what makes a real launch fail
(Triton's OutOfResources); spills (local memory) are reported, not failed: they cost speed, not correctness.

  python benchmarks/gpu/compile_check.py --arch 90 --arch 100 [--out DIR]    (exit 1 if any launch fails)

Run it without TRITON_INTERPRET: under the interpreter, triton.jit makes interpreted functions, which compile nothing.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Shared memory one block may use (the opt-in maximum), by compute capability: 227 KiB on Hopper (9.0) and on
# Blackwell's datacenter parts (10.0, 10.3). Triton refuses a launch above it.
MAX_SHARED_PER_BLOCK = {90: 232448, 100: 232448, 103: 232448}
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Launch:
    """One compiled launch: which kernel, for which call of which wrapper, and what the cubin uses."""

    case: str
    kernel: str
    error: str | None = None
    registers: int | None = None
    shared: int | None = None
    local: int | None = None
    stack: int | None = None
    num_warps: int | None = None

    def fails(self, arch: int) -> str | None:
        if self.error is not None:
            return self.error
        if self.shared is not None and self.shared > MAX_SHARED_PER_BLOCK[arch]:
            return f"needs {self.shared} B of shared memory per block, sm_{arch} has {MAX_SHARED_PER_BLOCK[arch]}"
        return None

    def markdown(self, arch: int, count: int) -> str:
        why = self.fails(arch)
        kernel = self.kernel if count == 1 else f"{self.kernel} (x{count} launches)"
        if self.error is not None:
            return f"| {self.case} | {kernel} | - | - | - | - | FAIL: {why} |"
        spills = "none" if not self.local and not self.stack else f"{self.local} B local, {self.stack} B stack"
        return f"| {self.case} | {kernel} | {self.num_warps} | {self.registers} | {self.shared} | {spills} | {'ok' if why is None else 'FAIL: ' + why} |"


class CompileOnlyDriver:
    """Triton's active driver, as far as compiling goes: the target is named, device 0 and stream 0 stand in. Anything
    a launch would need (the launcher, device properties) is absent, so nothing can run by accident."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"the compile-only driver has no {name}: a kernel was about to run, not only compile")


def summary(e: Exception) -> str:
    """One table cell for an error: its type and the cause, which Triton's compile errors give last (after the source excerpt)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {(lines[-1] if lines else '')[:200]}".replace("|", "/")


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG, SHARED, LOCAL and STACK of the cubin's one function, by `cuobjdump --dump-resource-usage`."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if "REG:" in line)
    return {key: int(value) for key, value in re.findall(r"(REG|SHARED|LOCAL|STACK):(\d+)", line)}


class Recorder:
    """While installed, every Triton launch in this process is compiled for `target` and recorded, and never run; the
    package's wrappers accept CPU tensors meanwhile. Everything it changes is put back on exit."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        if os.environ.get("TRITON_INTERPRET", "0") == "1":
            raise RuntimeError("compile_check: unset TRITON_INTERPRET (the interpreter compiles nothing)")
        self.launches: list[Launch] = []
        self.compiled: set[Any] = set()
        self.case = ""
        self._target = GPUTarget("cuda", arch, 32)
        self._undo: list[Callable[[], None]] = []

    def _replace(self, owner: Any, name: str, value: Any) -> None:
        original = getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, original))

    def __enter__(self) -> Recorder:
        from triton.runtime.driver import driver
        from triton.runtime.jit import JITFunction

        from openk3.ops.triton import mla_decode, mla_prefill, moe_mxfp4, mxfp4_decode

        recorder, run = self, JITFunction.run

        def compile_only(fn: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            recorder.compiled.add(fn)
            fn.device_caches.clear()  # its binder holds the target it was made for: another arch must not reuse it
            try:
                kernel = run(fn, *args, grid=grid, warmup=True, **kwargs)  # warmup: compile, do not launch
                usage = resource_usage(kernel.asm["cubin"])
            except Exception as e:  # a compile error is this launch's result, the next case still runs
                recorder.launches.append(Launch(recorder.case, fn.__name__, error=summary(e)))
                return None
            recorder.launches.append(
                Launch(
                    recorder.case,
                    fn.__name__,
                    registers=usage["REG"],
                    shared=int(kernel.metadata.shared),
                    local=usage["LOCAL"],
                    stack=usage["STACK"],
                    num_warps=int(kernel.metadata.num_warps),
                )
            )
            return kernel

        try:
            # the wrappers refuse CPU tensors outside the interpreter, since a kernel cannot read them; nothing runs here
            for module in (mla_decode, mla_prefill, moe_mxfp4, mxfp4_decode):
                self._replace(module, "require_launchable", lambda *args, **kwargs: None)
            # set_active's counterpart, reset_active(), would build the default driver, which needs a GPU: the one that
            # was active goes back instead
            self._replace(driver, "_active", CompileOnlyDriver(self._target))
            self._replace(JITFunction, "run", compile_only)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for fn in self.compiled:  # the binders made for this target must not serve a later launch on a real GPU
            fn.device_caches.clear()
        while self._undo:
            self._undo.pop()()

    def call(self, case: str, wrapper: Callable[..., Any], *args: Any) -> None:
        """Call wrapper(*args); its launches are compiled under `case`. A wrapper that fails before its launch fails the case."""
        self.case = case
        before = len(self.launches)
        try:
            wrapper(*args)
        except Exception as e:
            self.launches.append(Launch(case, "(wrapper)", error=summary(e)))
            return
        if len(self.launches) == before:
            self.launches.append(Launch(case, "(wrapper)", error="no Triton launch was made"))


def random_mxfp4(g: torch.Generator, experts: int, rows: int, cols: int) -> Any:
    """Packed E2M1 codes and E8M0 scales near 2^0 (any bytes compile alike; these keep the CPU-side math finite)."""
    from openk3.ops.mxfp4 import MX_BLOCK, MXFP4Tensor

    packed = torch.randint(0, 256, (experts, rows, cols // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 130, (experts, rows, cols // MX_BLOCK), generator=g, dtype=torch.uint8)
    return MXFP4Tensor(packed, scales)


def k3_cases(recorder: Recorder, dtypes: list[torch.dtype]) -> None:
    """The package's wrappers at K3's widths (openk3.config.presets.k3), a few rows each: the widths, not the row counts,
    decide the compiled kernel."""
    from openk3.config.presets import k3
    from openk3.ops.activation import situ_glu
    from openk3.ops.moe.packed_bank import PackedMXFP4ExpertBank
    from openk3.ops.triton.mla_decode import latent_attention_paged
    from openk3.ops.triton.mla_prefill import mla_prefill_latent
    from openk3.ops.triton.moe_mxfp4 import moe_experts_mxfp4
    from openk3.ops.triton.mxfp4_decode import dequantize_triton

    cfg = k3()
    mla, moe = cfg.mla, cfg.moe
    assert mla is not None and moe is not None
    h, lr, dr, dn, dv = mla.num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim
    d, inter = moe.latent_size or cfg.hidden_size, moe.moe_intermediate_size
    g = torch.Generator().manual_seed(0)
    page_size, pages = 16, 8
    bank = PackedMXFP4ExpertBank(*(random_mxfp4(g, 2, rows, cols) for rows, cols in ((inter, d), (inter, d), (d, inter))))
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        q = torch.randn(3, h, lr + dr, generator=g)
        pool = torch.randn(pages, page_size, lr + dr, generator=g).to(dtype)
        table, lens = torch.arange(6).view(3, 2), torch.tensor([20, 1, 32])
        recorder.call(f"MLA decode, {name} latents (H {h}, Lr {lr}, Dr {dr})", latent_attention_paged, q, pool, table, lens, lr)
        t, s = 20, 50
        qn, qp = torch.randn(t, h, dn, generator=g).to(dtype), torch.randn(t, h, dr, generator=g).to(dtype)
        ckv, kpe = torch.randn(s, lr, generator=g).to(dtype), torch.randn(s, dr, generator=g).to(dtype)
        wuk, wuv = torch.randn(h, dn, lr, generator=g).to(dtype), torch.randn(h, dv, lr, generator=g).to(dtype)
        recorder.call(f"MLA prefill, {name} latents (H {h}, Lr {lr}, Dr {dr})", mla_prefill_latent, qn, qp, ckv, kpe, wuk, wuv, 0.1, s - t)
        x = torch.randn(5, d, generator=g).to(dtype)
        idx = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]])
        weight = torch.rand(5, 2, generator=g)
        recorder.call(f"MoE experts MXFP4, {name} x (D {d}, I {inter})", moe_experts_mxfp4, x, idx, weight, bank, situ_glu)
        recorder.call(f"MXFP4 dequantise to {name}", dequantize_triton, bank.w2.packed[0], bank.w2.scales[0], dtype)


def report(arch: int, launches: list[Launch]) -> str:
    import triton

    lines = [
        f"### sm_{arch} (Triton {triton.__version__}, torch {torch.__version__}, compiled on {platform.machine()} without a GPU)",
        "",
        f"Shared memory per block may not exceed {MAX_SHARED_PER_BLOCK[arch]} B.",
        "",
        "| wrapper call | kernel | warps | registers / thread | shared B | spills | check |",
        "|---|---|---|---|---|---|---|",
    ]
    counts: dict[Launch, int] = {}  # a wrapper's launches that compiled to the same use are one row (the MoE's gate and up)
    for launch in launches:
        counts[launch] = counts.get(launch, 0) + 1
    return "\n".join(lines + [launch.markdown(arch, count) for launch, count in counts.items()]) + "\n"


def check(arch: int, dtypes: list[torch.dtype]) -> list[Launch]:
    with Recorder(arch) as recorder:
        k3_cases(recorder, dtypes)
    return recorder.launches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, action="append", choices=sorted(MAX_SHARED_PER_BLOCK), help="compute capability x 10 (repeatable; default 90)")
    parser.add_argument("--dtype", action="append", choices=["bfloat16", "float16", "float32"], help="repeatable; default bfloat16 and float32")
    parser.add_argument("--out", type=Path, help="also write the table to DIR/gpu_compile.md")
    args = parser.parse_args(argv)
    dtypes = [getattr(torch, name) for name in (args.dtype or ["bfloat16", "float32"])]
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    sections = [f"`python benchmarks/gpu/compile_check.py {' '.join(argv if argv is not None else sys.argv[1:])}` at commit {commit or '?'}\n"]
    failed = 0
    for arch in args.arch or [90]:
        launches = check(arch, dtypes)
        failed += sum(launch.fails(arch) is not None for launch in launches)
        sections.append(report(arch, launches))
    text = "\n".join(sections)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_compile.md").write_text(text)
    if failed:
        print(f"compile_check: {failed} launch(es) failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
