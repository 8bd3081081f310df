"""GPU kernels against their torch baselines, one markdown table: the Python side of benchmarks/gpu/run.sh.

Each row checks the kernel against its baseline on the same inputs first; a row whose check fails reports FAIL and no
ratio. Ratios are baseline time / kernel time, both measured in this run, on this machine.
  python benchmarks/gpu/driver.py --out DIR            on CUDA: full shapes, each bench in a process of its own
  python benchmarks/gpu/driver.py --dry-run --out DIR  on CPU, TRITON_INTERPRET=1: the same code at tiny shapes (tested)
gpu.md is rewritten after every bench, so a run stopped by its time limit keeps what it finished.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
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
    kda_decode: tuple[int, int, int]  # N sequences of one token, H, K (= V)
    k3_slice: tuple[int, int, int]  # prefill chunk t, decode batch N, decode context
    engine_batches: tuple[int, ...]
    repeats: int


FULL = Shapes(
    moe=(512, 8, 64, 512, 1024),
    mla=(32, 64, 4096, 512, 64),
    mla_prefill=(2048, 16384, 16, 512),
    kda=(4096, 16, 128),
    kda_decode=(64, 96, 128),
    k3_slice=(2048, 64, 4096),
    engine_batches=(1, 16, 64),
    repeats=20,
)
DRY = Shapes(
    moe=(5, 2, 4, 32, 64),
    mla=(2, 2, 40, 32, 16),
    mla_prefill=(20, 50, 2, 32),
    kda=(16, 2, 16),
    kda_decode=(3, 2, 16),
    k3_slice=(12, 2, 20),
    engine_batches=(1, 2),
    repeats=1,
)


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


def paged_latents(s: Shapes, device: torch.device, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(latent pool [pages, PS, R], page table [N, P] of scattered pages, lengths [N]) for s.mla's N sequences of `context`
    cached rows each."""
    n, _, ctx, lr, dr = s.mla
    page = 64 if ctx >= 64 else 8
    pages = -(-ctx // page)
    pool = torch.randn(n * pages, page, lr + dr, generator=g, device=device).to(dtype)
    table = torch.randperm(n * pages, generator=g, device=device).view(n, pages)
    return pool, table, torch.full((n,), ctx, device=device)


def bench_mla(s: Shapes, device: torch.device, dtype: torch.dtype) -> Row:
    from openk3.ops.mla.decode_cpu import latent_attention_torch
    from openk3.ops.triton.mla_decode import latent_attention_paged

    n, h, ctx, lr, dr = s.mla
    g = torch.Generator(device=device).manual_seed(0)
    pool, table, lens = paged_latents(s, device, dtype, g)
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


def kda_inputs(g: torch.Generator, lead: tuple[int, ...], h: int, dk: int) -> tuple[torch.Tensor, ...]:
    """q, k (L2-normalised), v, the log decay gate (<= 0) [*lead, H, K] and beta [*lead, H], drawn from `g` on its device."""
    import torch.nn.functional as F

    r = lambda *shape: torch.randn(*shape, generator=g, device=g.device)  # noqa: E731
    q, k = F.normalize(r(*lead, h, dk), dim=-1), F.normalize(r(*lead, h, dk), dim=-1)
    return q, k, r(*lead, h, dk), -F.softplus(r(*lead, h, dk)), torch.sigmoid(r(*lead, h))


def bench_kda(s: Shapes, device: torch.device, dry_run: bool) -> Row:
    from openk3.ops.kda.chunk import kda_chunk

    t, h, dk = s.kda
    q, k, v, gate, beta = kda_inputs(torch.Generator(device=device).manual_seed(0), (1, t), h, dk)
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


def bench_kda_decode(s: Shapes, device: torch.device, dry_run: bool) -> list[Row]:
    """The KDA decode step as the model runs it (model/kda.py): N sequences of one token on scattered state slots. openk3's
    torch step (ops/kda/decode_inplace.py on the gathered states, written back) against fla's fused recurrence through the
    seam (states turned V-first and back, ops/kda/fla_kernels.py); and the seam against fla called directly on openk3's
    own K-first layout, which needs no conversion: what the seam's two transposes and its checks cost."""
    from openk3.ops.kda.decode_inplace import kda_decode_

    n, h, dk = s.kda_decode
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, gate, beta = kda_inputs(g, (n,), h, dk)
    pool = torch.randn(2 * n, h, dk, dk, generator=g, device=device) * 0.1
    slots = torch.randperm(2 * n, generator=g, device=device)[:n]
    one_each = torch.arange(n + 1, device=device)
    shape = f"N={n} H={h} K=V={dk}"

    def torch_step() -> torch.Tensor:
        state = pool.index_select(0, slots)
        o = kda_decode_(q, k, v, gate, beta, state)
        pool.index_copy_(0, slots, state)
        return o

    names = (
        "KDA decode: fla fused_recurrent_kda (seam) vs openk3 torch step",
        "KDA decode: fla on K-first states vs the seam (its V-first conversions and checks)",
    )
    if dry_run and importlib.util.find_spec("fla") is None:  # the dry run checks the baseline runs and the rows are formed
        torch_step()
        return [Row(name, shape, "skipped (dry run: fla is not installed)") for name in names]
    from fla.ops.kda import fused_recurrent_kda  # runs under the interpreter too (tests/ops/test_kda_fla_interpreted.py)

    from openk3.ops.kda.fla_kernels import kda_recurrent_fla

    def seam_step() -> torch.Tensor:
        o, state = kda_recurrent_fla(q[None], k[None], v[None], gate[None], beta[None], None, pool.index_select(0, slots), one_each)
        pool.index_copy_(0, slots, state)
        return o[0]

    def key_first_step() -> torch.Tensor:
        o, state = fused_recurrent_kda(
            q[None], k[None], v[None], gate[None], beta[None], scale=None, initial_state=pool.index_select(0, slots),
            output_final_state=True, state_v_first=False, cu_seqlens=one_each,
        )  # fmt: skip
        pool.index_copy_(0, slots, state)
        return o[0]

    start = pool.clone()
    outs = []
    for step in (torch_step, seam_step, key_first_step):
        pool.copy_(start)
        outs.append((step(), pool.clone()))
    checks = [close(outs[1][0], outs[0][0], 2e-2), close(outs[2][0], outs[1][0], 2e-2)]
    states_ok = [close(outs[1][1], outs[0][1], 2e-2), close(outs[2][1], outs[1][1], 2e-2)]
    rows = [Row(name, shape, check if check != "ok" else state) for name, check, state in zip(names, checks, states_ok, strict=True)]
    for row, (base, kern) in zip(rows, ((torch_step, seam_step), (seam_step, key_first_step)), strict=True):
        if row.check == "ok":
            row.baseline_ms, row.kernel_ms = timed(base, s.repeats, device), timed(kern, s.repeats, device)
    return rows


def bench_mla_decode_sdpa(s: Shapes, device: torch.device, dtype: torch.dtype) -> Row:
    """The whole MLA decode attention two ways: per-head K and V expanded from the sequence's cached latents and torch's
    SDPA (what an implementation without weight absorption runs), against the absorbed query through the paged Triton
    kernel and u . W_uv (openk3's decode with mla_decode="triton")."""
    import torch.nn.functional as F

    from openk3.ops.triton.mla_decode import latent_attention_paged

    n, h, ctx, lr, dr = s.mla
    dn, dv = (128, 128) if lr >= 512 else (16, 16)
    g = torch.Generator(device=device).manual_seed(0)
    pool, table, lens = paged_latents(s, device, dtype, g)
    q_nope, q_pe = torch.randn(n, h, dn, generator=g, device=device).to(dtype), torch.randn(n, h, dr, generator=g, device=device).to(dtype)
    w_uk, w_uv = (torch.randn(h, w, lr, generator=g, device=device).mul(lr**-0.5).to(dtype) for w in (dn, dv))
    scale = (dn + dr) ** -0.5

    def sdpa() -> torch.Tensor:
        rows = pool[table].flatten(1, 2)[:, :ctx]  # [N, ctx, R]: every sequence's cached latents, in order
        c, k_pe = rows.split([lr, dr], dim=-1)
        k_nope = torch.einsum("nsl,hdl->nhsd", c, w_uk)
        keys = torch.cat([k_nope, k_pe[:, None].expand(n, h, ctx, dr)], dim=-1)
        values = torch.einsum("nsl,hdl->nhsd", c, w_uv)
        query = torch.cat([q_nope, q_pe], dim=-1)[:, :, None]
        return F.scaled_dot_product_attention(query, keys, values, scale=scale)[:, :, 0]

    def absorbed() -> torch.Tensor:
        q_lat = torch.einsum("nhd,hdl->nhl", q_nope.float(), w_uk.float())
        q_nhr = torch.cat([q_lat, q_pe.float()], dim=-1) * scale
        u = latent_attention_paged(q_nhr, pool, table, lens, lr)
        return torch.einsum("nhl,hdl->nhd", u, w_uv.float()).to(dtype)

    row = Row("MLA decode attention: absorbed Triton vs expanded K/V + SDPA", f"N={n} H={h} ctx={ctx} Lr={lr}", close(absorbed(), sdpa(), 3e-2))
    if row.check == "ok":
        row.baseline_ms, row.kernel_ms = timed(sdpa, s.repeats, device), timed(absorbed, s.repeats, device)
    return row


def k3_slice_model(device: torch.device, dtype: torch.dtype, dry_run: bool) -> Any:
    """K3's widths over two layers, a KDA and an MLA layer, each with the latent MoE over all 896 routed experts as packed
    MXFP4 (about 31 GB of experts), built on the meta device and filled on `device` with random weights (std 0.02, E8M0
    scales near 2^-8, balanced routing; about 38 GB in all); the debug model's widths in the dry run."""
    from openk3.config.presets import debug, k3
    from openk3.model import K3ForCausalLM, OpChoice
    from openk3.model.weights import cast_model
    from openk3.serve.prepare import prepare_for_serving

    config = (debug() if dry_run else k3()).replace(num_hidden_layers=2, mla_layers=(1,), first_k_dense_replace=0)
    with torch.device("meta"):
        model = K3ForCausalLM(config, OpChoice(packed_experts=True))
    cast_model(model, dtype)  # on meta, free: the weights are then allocated in their serving dtypes, never in fp32 first
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            parts = name.split(".")
            owner, leaf = (parts[-2] if len(parts) > 1 else ""), parts[-1]
            if t.dtype == torch.uint8:  # packed E2M1 codes (any byte), E8M0 scales near 2^-8 (weights of about 0.02)
                t.random_(0, 256, generator=g) if leaf.endswith("_packed") else t.random_(116, 122, generator=g)
            elif name.endswith("_res_proj.weight") or leaf == "e_score_correction_bias":
                t.zero_()
            elif "norm" in owner or leaf in ("A_log", "dt_bias"):
                t.fill_(1.0)
            else:
                t.normal_(0.0, 0.02, generator=g)
    model.eval()
    prepare_for_serving(model, device)  # the serving layout (fused projections), as an engine runs it
    return model


def bench_k3_slice(s: Shapes, device: torch.device, dtype: torch.dtype, dry_run: bool) -> list[Row]:
    """A prefill chunk of one sequence and a decode step of N sequences at a long context through the K3 slice
    (k3_slice_model), on the torch forms ("auto" on CUDA) against the GPU kernels chosen by name: fla for KDA, Triton for
    the MLA prefill and decode and the MXFP4 experts (the dry run keeps KDA on torch: fla needs CUDA)."""
    from openk3.model import CacheTensors, ForwardBatch, OpChoice
    from openk3.ops.registry import OpTarget

    t, n, ctx = s.k3_slice
    if device.type == "cuda":
        gc.collect()  # engines kept alive by reference cycles hold graph memory pools
        torch.cuda.empty_cache()  # the earlier rows' blocks, before some 31 GB of experts
    model = k3_slice_model(device, dtype, dry_run)
    target = OpTarget(device="cuda", dtype=dtype)  # the dry run selects the CUDA entries too: CPU tensors run under the interpreter
    forms = {
        "torch": OpChoice(packed_experts=True),
        "kernels": OpChoice(kda="auto" if dry_run else "fla", mla="triton", mla_decode="triton", moe="triton", packed_experts=True),
    }
    page = 64 if not dry_run else 4
    pages_per_seq = -(-(ctx + 1) // page)
    cache = CacheTensors.allocate(model.config, num_slots=n + 1, num_pages=n * pages_per_seq + -(-t // page), page_size=page, dtype=dtype, device=device)
    g = torch.Generator(device=device).manual_seed(1)
    for pool in cache.pools():  # decode reads ctx cached positions per sequence: any values do for timing
        pool.normal_(0.0, 0.1, generator=g)
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (t,), generator=g, device=device).tolist()
    prefill = ForwardBatch.for_step([tokens], [0], [n], torch.arange(n * pages_per_seq, n * pages_per_seq + -(-t // page), device=device)[None])
    table = torch.arange(n * pages_per_seq, device=device).view(n, pages_per_seq)
    decode = ForwardBatch.for_step([[7 + i] for i in range(n)], [ctx] * n, list(range(n)), table)
    start = [p.clone() for p in cache.pools()]

    def step(batch: Any) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            with torch.no_grad():
                return model(batch, cache)

        return run

    rows = []
    for label, batch, shape in (("prefill chunk", prefill, f"t={t}"), ("decode step", decode, f"N={n} ctx={ctx}")):
        results = {}
        for form, ops in forms.items():
            for pool, saved in zip(cache.pools(), start, strict=True):
                pool.copy_(saved)
            model.select_ops(ops, target)
            results[form] = step(batch)()
        row = Row(f"K3 slice (KDA + MLA layer, 896 MXFP4 experts), {label}: kernels vs torch forms", shape, close(results["kernels"], results["torch"], 5e-2))
        if row.check == "ok":
            times = {}
            for form, ops in forms.items():
                model.select_ops(ops, target)
                times[form] = timed(step(batch), max(1, s.repeats // 4), device)
            row.baseline_ms, row.kernel_ms = times["torch"], times["kernels"]
        rows.append(row)
    return rows


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
    """The checkout's commit; OPENK3_COMMIT where the tree travelled without its .git (a lent GPU machine)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("OPENK3_COMMIT", "unknown")


Table = str  # "kernels": Row results; "engine": markdown lines of the engine table


def benches(s: Shapes, device: torch.device, dtype: torch.dtype, dry_run: bool) -> dict[str, tuple[Table, Callable[[], Any]]]:
    """Every bench by name, with the table its rows go to: cheapest first, the K3 slice (about 38 GB) last."""
    out: dict[str, tuple[Table, Callable[[], Any]]] = {
        "MoE experts": ("kernels", lambda: bench_moe(s, device, dtype)),
        "MLA decode": ("kernels", lambda: bench_mla(s, device, dtype)),
        "MLA decode vs SDPA": ("kernels", lambda: bench_mla_decode_sdpa(s, device, dtype)),
        "MLA prefill": ("kernels", lambda: bench_mla_prefill(s, device, dtype)),
        "KDA prefill": ("kernels", lambda: bench_kda(s, device, dry_run)),
        "KDA decode": ("kernels", lambda: bench_kda_decode(s, device, dry_run)),
    }
    for batch in s.engine_batches:
        out[f"engine batch {batch}"] = ("engine", lambda batch=batch: engine_row(batch, device, dry_run))  # type: ignore[misc]
    out["K3 slice"] = ("kernels", lambda: bench_k3_slice(s, device, dtype, dry_run))
    return out


def failure(name: str, table: Table, why: str) -> Any:
    why = why.replace("|", "/")
    if table == "engine":
        return f"| {name.removeprefix('engine batch ')} | FAIL ({why}) | - | - | - |"
    return Row(name, "-", f"FAIL ({why})")


def run_here(name: str, table: Table, make: Callable[[], Any]) -> list[Any]:
    """A bench's rows, or one FAIL row naming the exception: one broken kernel must not cost the rest of the run."""
    try:
        rows = make()
    except Exception as e:  # reported in the table and on stderr, and the run goes on
        traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0][:160]
        return [failure(name, table, f"{type(e).__name__}: {first}")]
    return rows if isinstance(rows, list) else [rows]


def run_isolated(name: str, table: Table, dry_run: bool, seconds: float) -> list[Any]:
    """The bench in a process of its own (`--child`), so that a fault that poisons the CUDA context (an illegal address, a
    device-side assert) or kills the process costs this bench's rows only; its output goes to this one's."""
    if seconds <= 0:
        return [failure(name, table, "not run: the driver's time budget was spent")]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--out", tmp, *(["--dry-run"] if dry_run else [])]
        try:
            ended = subprocess.run(cmd, timeout=seconds).returncode
        except subprocess.TimeoutExpired:
            return [failure(name, table, f"killed after the {seconds:.0f} s left of the driver's time budget")]
        result = Path(tmp) / "child.json"
        if not result.exists():
            return [failure(name, table, f"its process ended with {ended} before reporting: a crash or a GPU fault, see the log")]
        rows = json.loads(result.read_text())
    return [Row(**row) for row in rows] if table == "kernels" else rows


def run_child(name: str, table: Table, make: Callable[[], Any], out: Path) -> int:
    if os.environ.get("OPENK3_DRIVER_ABORT") == name:  # tests: a bench whose process dies, as a GPU fault can end it
        os.abort()
    rows = run_here(name, table, make)
    out.mkdir(parents=True, exist_ok=True)
    (out / "child.json").write_text(json.dumps([dataclasses.asdict(row) if isinstance(row, Row) else row for row in rows]))
    return 0


class Report:
    """gpu.md, rewritten after every bench: a run stopped by its time limit still leaves the rows it finished."""

    def __init__(self, out: Path, header: list[str], dry_run: bool) -> None:
        self.out, self.header, self.dry_run = out, header, dry_run
        self.kernels: list[Row] = []
        self.engine: list[str] = []
        out.mkdir(parents=True, exist_ok=True)

    def add(self, table: Table, rows: list[Any]) -> None:
        (self.kernels if table == "kernels" else self.engine).extend(rows)
        self.write()

    def failed(self) -> bool:
        return any(row.check.startswith("FAIL") for row in self.kernels) or any("FAIL" in line for line in self.engine)

    def lines(self, finished: bool) -> list[str]:
        return [
            *self.header,
            "| kernel vs baseline | shape | check | baseline ms | kernel ms | baseline / kernel |",
            "|---|---|---|---|---|---|",
            *(row.markdown(self.dry_run) for row in self.kernels),
            "",
            "Engine decode, embedded tiny model, 64 new tokens per request (prefill included in the time), eager vs CUDA graphs:",
            "",
            "| batch | eager tok/s | graphs tok/s | graphs / eager | greedy sequences equal |",
            "|---|---|---|---|---|",
            *self.engine,
            "",
            *([] if finished else ["**Incomplete: the run stopped before every row was measured.**", ""]),
        ]

    def write(self, finished: bool = False) -> None:
        (self.out / "gpu.md").write_text("\n".join(self.lines(finished)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes (proves the script, measures nothing)")
    parser.add_argument("--benches", help="comma-separated bench names to run (default: all)")
    isolation = parser.add_mutually_exclusive_group()
    isolation.add_argument("--isolate", action="store_true", default=None, help="each bench in its own process (the default on CUDA)")
    isolation.add_argument("--in-process", dest="isolate", action="store_false", help="every bench in this process (the default in a dry run)")
    parser.add_argument("--budget-s", type=float, default=280.0, help="with isolation: the time every bench together may take")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # run one bench, write its rows to OUT/child.json (run_isolated)
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        device, dtype, shapes = torch.device("cpu"), torch.float32, DRY
    else:
        if not torch.cuda.is_available():
            print("driver.py: no CUDA device (use --dry-run on CPU)", file=sys.stderr)
            return 2
        device, dtype, shapes = torch.device("cuda"), torch.bfloat16, FULL
    every = benches(shapes, device, dtype, args.dry_run)
    if args.child is not None:
        return run_child(args.child, *every[args.child], args.out)
    chosen = list(every) if args.benches is None else [name.strip() for name in args.benches.split(",")]
    unknown = [name for name in chosen if name not in every]
    if unknown:
        parser.error(f"unknown bench {', '.join(map(repr, unknown))}: expected some of {', '.join(every)}")
    isolate = not args.dry_run if args.isolate is None else args.isolate
    import triton

    machine = torch.cuda.get_device_name() if device.type == "cuda" else f"{platform.processor() or platform.machine()} (dry run)"
    report = Report(
        args.out,
        [
            f"# GPU kernels vs torch baselines{' (DRY RUN: CPU interpreter, tiny shapes, timings meaningless)' if args.dry_run else ''}",
            "",
            f"Command: `python benchmarks/gpu/driver.py {' '.join(argv if argv is not None else sys.argv[1:])}`; machine: {machine}; "
            f"commit {git_commit()}; torch {torch.__version__}; triton {triton.__version__}.",
            "",
        ],
        args.dry_run,
    )
    deadline = time.monotonic() + args.budget_s
    for name in chosen:
        table, make = every[name]
        start = time.monotonic()
        report.add(table, run_isolated(name, table, args.dry_run, deadline - start) if isolate else run_here(name, table, make))
        print(f"driver.py: {name}: {time.monotonic() - start:.1f} s", flush=True)  # sizes the next run's budget
    report.write(finished=True)
    print("\n".join(report.lines(finished=True)))
    return 1 if report.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
