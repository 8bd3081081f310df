"""GPU kernels against their torch baselines, one markdown table: the Python side of benchmarks/gpu/run.sh.

Each row checks the kernel against its baseline on the same inputs first; a row whose check fails reports FAIL and no
ratio. Ratios are baseline time / kernel time, both measured in this run, on this machine.
  python benchmarks/gpu/driver.py --out DIR            on CUDA: full shapes
  python benchmarks/gpu/driver.py --dry-run --out DIR  on CPU, TRITON_INTERPRET=1: the same code at tiny shapes (tested)
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Shapes:
    moe: tuple[int, int, int, int, int]  # T, k, E, I, D
    mla: tuple[int, int, int, int, int]  # N, H, context, Lr, Dr
    mla_prefill: tuple[int, int, int, int]  # chunk t, context s (chunk included), H, Lr (K3's Dn 128, Dr 64, Dv 128)
    kda: tuple[int, int, int]  # T, H, K (= V)
    engine_batches: tuple[int, ...]
    repeats: int


FULL = Shapes(
    moe=(512, 8, 64, 512, 1024), mla=(32, 64, 4096, 512, 64), mla_prefill=(2048, 16384, 16, 512), kda=(4096, 16, 128), engine_batches=(1, 16, 64), repeats=20
)
DRY = Shapes(moe=(5, 2, 4, 32, 64), mla=(2, 2, 40, 32, 16), mla_prefill=(20, 50, 2, 32), kda=(16, 2, 16), engine_batches=(1, 2), repeats=1)


@dataclass
class Row:
    name: str
    shape: str
    check: str  # "ok" or why it failed
    baseline_ms: float | None = None
    kernel_ms: float | None = None

    def markdown(self, dry_run: bool) -> str:
        if dry_run:  # the interpreter's timings say nothing about a GPU: the dry run proves the code path only
            return f"| {self.name} | {self.shape} | {self.check} | (dry run) | (dry run) | - |"
        if self.check != "ok" or self.baseline_ms is None or self.kernel_ms is None:
            return f"| {self.name} | {self.shape} | {self.check} | - | - | - |"
        return f"| {self.name} | {self.shape} | ok | {self.baseline_ms:.3f} | {self.kernel_ms:.3f} | {self.baseline_ms / self.kernel_ms:.2f}x |"


def timed(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """Milliseconds per call after one warm-up call (compilation, autotuning)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / repeats


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> str:
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))
    return "ok" if err <= tol else f"FAIL (relative error {err:.2e} > {tol:.0e})"


def bench_moe(s: Shapes, device: torch.device, dtype: torch.dtype) -> Row:
    from openk3.ops.activation import silu_glu
    from openk3.ops.moe.grouped import moe_experts_grouped
    from openk3.ops.moe.packed_bank import PackedMXFP4ExpertBank
    from openk3.ops.triton.moe_mxfp4 import moe_experts_mxfp4

    t, k, e, i, d = s.moe
    g = torch.Generator(device=device).manual_seed(0)
    w1, w3, w2 = (torch.randn(*shape, generator=g, device=device).mul(0.05) for shape in ((e, i, d), (e, i, d), (e, d, i)))
    packed = PackedMXFP4ExpertBank.from_dense(w1, w3, w2)
    dense = packed.materialize(dtype)  # the same (dequantised) weights in bf16: the baseline reads 16 bits per weight
    x = torch.randn(t, d, generator=g, device=device).to(dtype)
    idx = torch.rand(t, e, generator=g, device=device).topk(k, dim=1).indices
    wt = torch.rand(t, k, generator=g, device=device)
    base = lambda: moe_experts_grouped(x, idx, wt, dense, silu_glu)  # noqa: E731
    kern = lambda: moe_experts_mxfp4(x, idx, wt, packed, silu_glu)  # noqa: E731
    row = Row("MoE experts: MXFP4 Triton vs bf16 grouped matmul", f"T={t} k={k} E={e} I={i} D={d}", close(kern(), base(), 3e-2))
    if row.check == "ok":
        row.baseline_ms, row.kernel_ms = timed(base, s.repeats, device), timed(kern, s.repeats, device)
    return row


def bench_mla(s: Shapes, device: torch.device, dtype: torch.dtype) -> Row:
    from openk3.ops.mla.decode_cpu import latent_attention_torch
    from openk3.ops.triton.mla_decode import latent_attention_paged

    n, h, ctx, lr, dr = s.mla
    page = 64 if ctx >= 64 else 8
    pages = -(-ctx // page)
    g = torch.Generator(device=device).manual_seed(0)
    pool = torch.randn(n * pages, page, lr + dr, generator=g, device=device).to(dtype)
    table = torch.randperm(n * pages, generator=g, device=device).view(n, pages)
    lens = torch.full((n,), ctx, device=device)
    q = torch.randn(n, h, lr + dr, generator=g, device=device) * (lr + dr) ** -0.5
    base = lambda: latent_attention_torch(q, pool, table, lens, lr)  # noqa: E731
    kern = lambda: latent_attention_paged(q, pool, table, lens, lr)  # noqa: E731
    row = Row("MLA decode latent attention: Triton vs torch (gathered pages)", f"N={n} H={h} ctx={ctx} Lr={lr} Dr={dr}", close(kern(), base(), 2e-2))
    if row.check == "ok":
        row.baseline_ms, row.kernel_ms = timed(base, s.repeats, device), timed(kern, s.repeats, device)
    return row


def bench_mla_prefill(s: Shapes, device: torch.device, dtype: torch.dtype) -> Row:
    from openk3.ops.mla.sdpa import mla_expanded_sdpa
    from openk3.ops.triton.mla_prefill import mla_prefill_latent

    t, ctx, h, lr = s.mla_prefill
    dn, dr, dv = (128, 64, 128) if lr >= 512 else (16, 8, 16)
    g = torch.Generator(device=device).manual_seed(0)
    q_nope, q_pe = (torch.randn(t, h, w, generator=g, device=device).to(dtype) for w in (dn, dr))
    c_kv, k_pe = torch.randn(ctx, lr, generator=g, device=device).to(dtype), torch.randn(ctx, dr, generator=g, device=device).to(dtype)
    w_uk, w_uv = (torch.randn(h, w, lr, generator=g, device=device).to(dtype) * lr**-0.5 for w in (dn, dv))
    args = (q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, (dn + dr) ** -0.5, ctx - t)
    base = lambda: mla_expanded_sdpa(*args)  # noqa: E731
    kern = lambda: mla_prefill_latent(*args)  # noqa: E731
    row = Row("MLA prefill chunk: Triton latent vs expanded K/V + SDPA", f"t={t} ctx={ctx} H={h} Lr={lr}", close(kern(), base(), 3e-2))
    if row.check == "ok":
        row.baseline_ms, row.kernel_ms = timed(base, s.repeats, device), timed(kern, s.repeats, device)
    return row


def bench_kda(s: Shapes, device: torch.device, dry_run: bool) -> Row:
    import torch.nn.functional as F

    from openk3.ops.kda.chunk import kda_chunk

    t, h, dk = s.kda
    g = torch.Generator(device=device).manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=g, device=device)  # noqa: E731
    q, k = F.normalize(r(1, t, h, dk), dim=-1), F.normalize(r(1, t, h, dk), dim=-1)
    v, gate, beta = r(1, t, h, dk), -F.softplus(r(1, t, h, dk)), torch.sigmoid(r(1, t, h))
    shape = f"T={t} H={h} K=V={dk}"
    base = lambda: kda_chunk(q, k, v, gate, beta)  # noqa: E731
    if dry_run:  # fla's kernels need a GPU; the dry run checks the baseline runs and the row is formed
        base()
        return Row("KDA prefill: fla chunk_kda vs openk3 chunk (torch)", shape, "skipped (dry run: fla needs CUDA)")
    from openk3.ops.kda.fla_kernels import kda_chunk_fla

    kern = lambda: kda_chunk_fla(q, k, v, gate, beta)  # noqa: E731
    row = Row("KDA prefill: fla chunk_kda vs openk3 chunk (torch)", shape, close(kern()[0], base()[0], 2e-2))
    if row.check == "ok":
        row.baseline_ms, row.kernel_ms = timed(base, s.repeats, device), timed(kern, s.repeats, device)
    return row


def engine_decode(batch: int, device: torch.device, new_tokens: int, cuda_graphs: bool) -> tuple[float, list[list[int]]]:
    """(decode tokens per second, the greedy tokens) of the embedded tiny model serving `batch` requests of `new_tokens`
    each; with cuda_graphs the decode steps replay graphs (serve/graphs.py), captured in the warm-up run."""
    from openk3.llm import LLM
    from openk3.serve.sampling import SamplingParams

    llm = LLM("tiny", num_pages=max(64, batch * 8), page_size=16, max_num_seqs=batch, max_model_len=128, device=str(device), cuda_graphs=cuda_graphs)
    prompts = [[1 + (i % 200), 2, 3] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up: the same steps, so every graph bucket the timed run needs is captured first
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    llm.close()
    return batch * new_tokens / seconds, [list(o.outputs[0].token_ids) for o in outs]


def engine_row(batch: int, device: torch.device, dry_run: bool) -> str:
    if dry_run:  # graphs need CUDA; tests/serve/test_decode_graphs.py proves them on CPU with a stand-in capture
        engine_decode(batch, device, 4, cuda_graphs=False)
        return f"| {batch} | (dry run) | (dry run) | (dry run) | (dry run) |"
    eager, want = engine_decode(batch, device, 64, cuda_graphs=False)
    graphed, got = engine_decode(batch, device, 64, cuda_graphs=True)
    same = sum(a == b for a, b in zip(got, want, strict=True))
    return f"| {batch} | {eager:.1f} | {graphed:.1f} | {graphed / eager:.2f} | {same}/{batch} |"


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes (proves the script, measures nothing)")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, dtype, shapes = torch.device("cpu"), torch.float32, DRY
    else:
        if not torch.cuda.is_available():
            print("driver.py: no CUDA device (use --dry-run on CPU)", file=sys.stderr)
            return 2
        device, dtype, shapes = torch.device("cuda"), torch.bfloat16, FULL
    rows = [bench_moe(shapes, device, dtype), bench_mla(shapes, device, dtype), bench_mla_prefill(shapes, device, dtype)]
    rows.append(bench_kda(shapes, device, args.dry_run))
    engine = [engine_row(batch, device, args.dry_run) for batch in shapes.engine_batches]
    machine = torch.cuda.get_device_name() if device.type == "cuda" else f"{platform.processor() or platform.machine()} (dry run)"
    lines = [
        f"# GPU kernels vs torch baselines{' (DRY RUN: CPU interpreter, tiny shapes, timings meaningless)' if args.dry_run else ''}",
        "",
        f"Command: `python benchmarks/gpu/driver.py {' '.join(argv if argv is not None else sys.argv[1:])}`; machine: {machine}; "
        f"commit {git_commit()}; torch {torch.__version__}.",
        "",
        "| kernel vs baseline | shape | check | baseline ms | kernel ms | baseline / kernel |",
        "|---|---|---|---|---|---|",
        *(row.markdown(args.dry_run) for row in rows),
        "",
        "Engine decode, embedded tiny model, 64 new tokens per request (prefill included in the time), eager vs CUDA graphs:",
        "",
        "| batch | eager tok/s | graphs tok/s | graphs / eager | greedy sequences equal |",
        "|---|---|---|---|---|",
        *engine,
        "",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 1 if any(row.check.startswith("FAIL") for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
