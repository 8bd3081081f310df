"""Gated Multi-head Latent Attention (NoPE), the full-attention layer of the hybrid.

Legend: T packed tokens, N sequences, D hidden, H heads, Dn/Dr/Dv qk_nope/qk_rope/v head dims, Lr kv_lora_rank,
R = Lr + Dr latent width, NP pages, PS page size. Parameter names are the checkpoint's.

Only the latent [c_kv (post-norm) | k_pe] is cached: R values per token per layer. Prefill expands K/V per sequence;
decode, and each row of a stepwise batch (model/stepwise.py), attends in latent space over the pages (absorbed form).
The K3 output gate sigmoid(W_g x) multiplies the per-head attention output before o_proj; Kimi Linear has no gate.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from openk3.config import ModelConfig
from openk3.model.batch import ForwardBatch
from openk3.model.layers import Linear, ProjectionGroup, RMSNorm
from openk3.ops.mla import split_kv_b
from openk3.ops.mla.fp8_latent import pack_fp8_latent, unpack_fp8_latent
from openk3.ops.registry import CPU_INFERENCE, OpTarget, op

MLA_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm use 1e-6 in every reference, not rms_norm_eps


def write_latents(pool_PSR: torch.Tensor, page_table: torch.Tensor, batch: ForwardBatch, latent_TR: torch.Tensor) -> None:
    """Scatter the step's new latents into their pages: token at position p of sequence i goes to page_table[i, p // PS]
    (the rows computed once per step: ForwardBatch.latent_rows)."""
    page_size = pool_PSR.shape[1]
    index = batch.latent_rows(page_size, page_table)
    rows = pack_fp8_latent(latent_TR) if pool_PSR.dtype == torch.uint8 else latent_TR.to(pool_PSR.dtype)
    if pool_PSR.is_contiguous():  # the pools are allocated so: one row copy per token into the flat view
        pool_PSR.view(-1, pool_PSR.shape[2]).index_copy_(0, index, rows)
    else:
        pool_PSR[index // page_size, index % page_size] = rows


def readable_pages(pool: torch.Tensor, page_table: torch.Tensor, latent_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(pool, page table) the attention ops read. A plain pool as it is; an FP8 pool (uint8 packed rows,
    ops/mla/fp8_latent.py) as the step's pages only, dequantised to `dtype` into a pool of their own, and the table
    renumbered to it: the ops never see the packed format, and only the pages this step reads are expanded."""
    if pool.dtype != torch.uint8:
        return pool, page_table
    b, p = page_table.shape
    pages = unpack_fp8_latent(pool[page_table.reshape(-1)], latent_dim, dtype)
    return pages, torch.arange(b * p, device=page_table.device).view(b, p)


def read_latents(pool_PSR: torch.Tensor, pages_P: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached latents of one sequence, [length, R]."""
    page_size = pool_PSR.shape[1]
    n_pages = (length + page_size - 1) // page_size
    return pool_PSR[pages_P[:n_pages]].reshape(n_pages * page_size, -1)[:length]


class MLAInputs(NamedTuple):
    q_nope: torch.Tensor  # [T, H, Dn]
    q_pe: torch.Tensor  # [T, H, Dr]
    latent_TR: torch.Tensor  # [T, R]: [c_kv (post-norm) | k_pe], what the pages store
    gate_logits: torch.Tensor | None  # [T, H * Dv], None without the output gate


class GatedMLA(nn.Module):
    def __init__(self, config: ModelConfig, prefill_impl: str = "auto", input_size: int | None = None, norm_eps: float = MLA_NORM_EPS) -> None:
        """`input_size`: the width the input projections read (the hidden size, unless a draft layer reads a wider input:
        model/eagle3_mla.py's 2H); `norm_eps`: q_a_layernorm's and kv_a_layernorm's epsilon."""
        super().__init__()
        m = config.mla
        d = config.hidden_size
        d_in = input_size or d
        self.num_heads, self.nope, self.rope, self.v_dim, self.lora = m.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
        self.scale = m.qk_head_dim**-0.5
        if m.q_lora_rank is None:
            self.q_proj = Linear(d_in, m.num_heads * m.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(d_in, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, norm_eps)
            self.q_b_proj = Linear(m.q_lora_rank, m.num_heads * m.qk_head_dim, bias=False)
        self.q_lora = m.q_lora_rank is not None
        self.kv_a_proj_with_mqa = Linear(d_in, m.latent_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, norm_eps)
        self.kv_b_proj = Linear(m.kv_lora_rank, m.num_heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.output_gate = m.output_gate
        if m.output_gate:
            self.g_proj = Linear(d_in, m.num_heads * m.v_head_dim, bias=False)
        self.o_proj = Linear(m.num_heads * m.v_head_dim, d, bias=False)
        self.select(prefill_impl, CPU_INFERENCE)
        self.in_proj = ProjectionGroup(self._in_linears())  # q (or q_a), kv_a, g: the projections of the input

    def _in_linears(self) -> list[Linear]:
        linears = [self.q_a_proj if self.q_lora else self.q_proj, self.kv_a_proj_with_mqa]
        return linears + [self.g_proj] if self.output_gate else linears

    def select(self, prefill_impl: str, target: OpTarget, decode_impl: str = "auto") -> None:
        """The prefill attention by name (ops/registry.py "mla_prefill") and the decode attention over the pages
        ("mla_decode"), "auto" resolved for `target`; an "auto" decode is the definition's torch ops when the prefill is
        "naive", so that choosing the reference prefill makes the whole layer the reference."""
        self.prefill = op("mla_prefill", prefill_impl, target)
        self.decode = op("mla_decode", "naive" if decode_impl == "auto" and prefill_impl == "naive" else decode_impl, target)

    def input_projections(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q or q_a [T, *], kv_a [T, R], gate logits or None): the projections of x."""
        outs = self.in_proj(x_TD)
        return outs[0], outs[1], outs[2] if self.output_gate else None

    def project(self, x_TD: torch.Tensor) -> MLAInputs:
        """Everything the attention needs from x: the split queries, the new latents and the gate logits."""
        t = x_TD.shape[0]
        q_in, kv_a, gate_logits = self.input_projections(x_TD)
        q = self.q_b_proj(self.q_a_layernorm(q_in)) if self.q_lora else q_in
        q_nope, q_pe = q.view(t, self.num_heads, -1).split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = kv_a.split([self.lora, self.rope], dim=-1)
        latent_TR = torch.cat([self.kv_a_layernorm(c_kv), k_pe], dim=-1)
        return MLAInputs(q_nope, q_pe, latent_TR, gate_logits)

    def forward(self, x_TD: torch.Tensor, batch: ForwardBatch, latent_pool: torch.Tensor | None) -> torch.Tensor:
        inp = self.project(x_TD)
        page_table = batch.page_table
        if latent_pool is not None:
            assert page_table is not None
            write_latents(latent_pool, page_table, batch, inp.latent_TR)
            latent_pool, page_table = readable_pages(latent_pool, page_table, inp.latent_TR.shape[-1], inp.latent_TR.dtype)
        if batch.is_decode and latent_pool is not None:
            assert page_table is not None
            w_uk, w_uv = split_kv_b(self.kv_b_proj.weight, self.num_heads, self.nope, self.v_dim)
            out_THV = self.decode(inp.q_nope, inp.q_pe, latent_pool, page_table, batch.context_lens + 1, w_uk, w_uv, self.scale)
        elif batch.stepwise and latent_pool is not None:
            # one decode query per row, over its sequence's pages up to its own position (model/stepwise.py)
            assert page_table is not None
            w_uk, w_uv = split_kv_b(self.kv_b_proj.weight, self.num_heads, self.nope, self.v_dim)
            rows_table = page_table.index_select(0, batch.stepwise_plan.seq_of_row)
            out_THV = self.decode(inp.q_nope, inp.q_pe, latent_pool, rows_table, batch.positions + 1, w_uk, w_uv, self.scale)
        else:
            out_THV = self.attend_prefill(inp, batch, latent_pool, page_table)
        return self.output(out_THV, inp.gate_logits, x_TD.dtype)

    def output(self, out_THV: torch.Tensor, gate_logits: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """The K3 output gate on each head's attention output, then o_proj: [T, D]."""
        t = out_THV.shape[0]
        if gate_logits is not None:
            out_THV = out_THV * torch.sigmoid(gate_logits.float()).view(t, self.num_heads, self.v_dim).to(out_THV.dtype)
        return self.o_proj(out_THV.reshape(t, self.num_heads * self.v_dim).to(dtype))

    def attend_prefill(self, inp: MLAInputs, batch: ForwardBatch, latent_pool: torch.Tensor | None, page_table: torch.Tensor | None = None) -> torch.Tensor:
        """Per sequence: its queries against its whole context (cached latents read back from the pages, which must
        already hold this step's, or this step's latents when there is no cache): [T, H, Dv]. `page_table`: the table
        of a pool already made readable (`readable_pages`); None: the batch's, over `latent_pool` as stored."""
        if latent_pool is not None and page_table is None:
            assert batch.page_table is not None
            latent_pool, page_table = readable_pages(latent_pool, batch.page_table, inp.latent_TR.shape[-1], inp.latent_TR.dtype)
        w_uk, w_uv = split_kv_b(self.kv_b_proj.weight, self.num_heads, self.nope, self.v_dim)
        q_nope, q_pe, latent_TR = inp.q_nope, inp.q_pe, inp.latent_TR
        outs = []
        cu = batch.cu_seqlens.tolist()
        ctx = batch.context_lens.tolist()
        for i in range(batch.num_seqs):
            lo, hi = cu[i], cu[i + 1]
            if latent_pool is not None:
                assert page_table is not None
                lat = read_latents(latent_pool, page_table[i], ctx[i] + hi - lo)
            else:
                lat = latent_TR[lo:hi]
            c, kpe = lat.split([self.lora, self.rope], dim=-1)
            outs.append(self.prefill(q_nope[lo:hi], q_pe[lo:hi], c, kpe, w_uk, w_uv, self.scale, ctx[i]))
        return torch.cat(outs, dim=0)
