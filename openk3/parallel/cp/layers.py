"""Context-parallel forms of the two attention layers, swapped in for one prefill (prefill.py) around the layer modules.

Legend: T prompt tokens, T_r this rank's tokens (positions [lo, hi)), D hidden, R MLA latent width, C = 3P conv
channels, W conv kernel, H K V the KDA heads and head dims.

- MLA: the latents are what every query needs and they are small (R values per token), so each rank computes its own
  T_r rows, all ranks all-gather them, every rank writes all T into its pages, and each rank attends its own queries over
  positions [0, hi) read back from the pages: the same computation as a one-process prefill of those rows (exact). With
  decode context parallelism (sharded_mla.py) each rank writes only the gathered rows it owns and reads the context
  before the step from every rank's share.
- KDA: a recurrence. Rank r's first tokens need rank r - 1's last W - 1 pre-conv inputs and its end state. The conv
  window depends only on this layer's input, so it is handed on right after the short conv, before the recurrence; the
  projections, the conv and the gates of rank r thus overlap rank r - 1's recurrence, and only the recurrence itself waits
  for the incoming state. Rank r hands its end state on as soon as its recurrence ends, before the output norm, gate and
  o_proj and the MLP that follow. Across layers this is a wavefront (rank 0 runs layer l + 1 while rank 1 runs layer l),
  cut at every MLA layer, whose all-gather waits for every rank. The prefix cache's states inside the step
  (ForwardBatch.state_cuts) are taken by the rank whose shard ends at or holds the cut (offsets in (lo, hi]): inside the
  shard by the one-process form (model/kda_cuts.py: the delta rule piece by piece, the conv window read from the inputs),
  at its end from the state and window the rank hands on; prefill.py then copies them to every rank.
  With `scan` (`--kda-cp scan`, kda_scan.py) no rank waits for the state: every rank runs its recurrence at once (all
  but the first over widened values from [0 | I]), a log-depth scan of point-to-point messages composes each rank's
  predecessors' state maps, and each rank corrects its output, end state and cut states with the start state they give
  it. The conv window is still handed on.

The module a wrapper replaces keeps its parameters; the wrapper holds it as `inner` only while attached.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.model.batch import ForwardBatch, StateCut
from openk3.model.kda import KDALayerCache, KimiDeltaAttention
from openk3.model.kda_cuts import check_cuts, conv_windows_at_cuts, prefill_with_cuts
from openk3.model.mla import GatedMLA, write_latents
from openk3.ops.kda.decode_step import delta_rule_inputs, gated_output
from openk3.parallel.cp.exchange import CPExchange, Received
from openk3.parallel.cp.kda_scan import Affine, corrected_output, identity_start, predecessors, widened
from openk3.parallel.cp.sharded_mla import LatentShards, attend_over, gather_context, write_owned

DeltaInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # q, k, v, g, beta
ShardRun = tuple[torch.Tensor, torch.Tensor, list[tuple[StateCut, torch.Tensor]]]  # o, end state, the cuts' states


def _one_slot(batch: ForwardBatch) -> torch.Tensor:
    if batch.state_slots is None or batch.num_seqs != 1:
        raise ValueError("context-parallel prefill runs one sequence with a cache (state_slots set, one sequence)")
    return batch.state_slots


class ContextParallelMLA(nn.Module):
    """`shards`: the pages hold this rank's share of the latents (decode context parallelism, sharded_mla.py): only the
    owned rows of the gathered latents are written, and the context before the step is gathered from every rank's share
    (logged as "mla_context") to attend over; None: every rank's pages hold every latent."""

    def __init__(self, inner: GatedMLA, exchange: CPExchange, layer: int, whole: ForwardBatch, shards: LatentShards | None = None) -> None:
        super().__init__()
        self.inner, self.exchange, self.layer, self.whole, self.shards = inner, exchange, layer, whole, shards

    def forward(self, x_TD: torch.Tensor, batch: ForwardBatch, latent_pool: torch.Tensor | None) -> torch.Tensor:
        _one_slot(batch)
        if latent_pool is None or batch.page_table is None:
            raise ValueError("context-parallel MLA needs the latent pages (a cache)")
        inp = self.inner.project(x_TD)
        ex = self.exchange
        all_TR = ex.gather_rows(inp.latent_TR, self.layer, "mla_latent")
        if self.shards is None:
            write_latents(latent_pool, batch.page_table, self.whole, all_TR)
            out_THV = self.inner.attend_prefill(inp, batch, latent_pool)
        else:
            write_owned(latent_pool, batch.page_table, self.whole, all_TR, self.shards)
            context = gather_context(latent_pool, batch.page_table, [ex.context_len], self.shards, ex.ctx)[0]
            row_bytes = latent_pool.shape[-1] * latent_pool.element_size()
            if ex.context_len > 0:
                ex.received.append(Received(self.layer, "mla_context", (ex.context_len - self.shards.held(ex.context_len)) * row_bytes))
            hi = ex.shards[ex.rank][1]
            latents = torch.cat([context, all_TR[:hi].to(context.dtype)])
            out_THV = attend_over(self.inner, inp.q_nope, inp.q_pe, latents, ex.context_len + ex.shards[ex.rank][0])
        return self.inner.output(out_THV, inp.gate_logits, x_TD.dtype)


class ContextParallelKDA(nn.Module):
    """`cuts`: this rank's snapshot cuts, offsets counted from its shard's start, in (0, T_r] (T_r: the shard's end)."""

    def __init__(self, inner: KimiDeltaAttention, exchange: CPExchange, layer: int, cuts: tuple[StateCut, ...] = (), scan: bool = False) -> None:
        super().__init__()
        self.inner, self.exchange, self.layer, self.cuts, self.scan = inner, exchange, layer, cuts, scan

    def forward(self, x_TD: torch.Tensor, batch: ForwardBatch, cache: KDALayerCache | None) -> torch.Tensor:
        slot = _one_slot(batch)
        if cache is None:
            raise ValueError("context-parallel KDA needs the state slots (a cache)")
        a, ex, tag = self.inner, self.exchange, 2 * self.layer
        qkv_TC, f_a, gate_in, b_TH = a.input_projections(x_TD)
        f_TP = a.f_b_proj(f_a)
        gate_TP = gate_in if a.full_rank_output_gate else a.g_b_proj(gate_in)
        w = a.layer_weights()
        conv_like = cache.conv_SCW[slot]
        starts_fresh = ex.context_len == 0  # rank 0 of a fresh sequence starts from zeros, after a context from its slot
        init_conv = ex.from_previous(conv_like, self.layer, "kda_conv", tag) if ex.rank > 0 else (None if starts_fresh else conv_like)
        y, conv_state = a.conv_prefill(qkv_TC[None], w.conv_weight_CW, init_conv, batch.cu_seqlens, activation="silu")
        conv_state = conv_state.to(conv_like.dtype)
        ex.to_next(conv_state, tag)
        qkvgb = delta_rule_inputs(y[0], f_TP, b_TH, w, a.num_heads)
        state_like = cache.state_SHKV[slot]
        n = qkv_TC.shape[0]
        inside = tuple(c for c in self.cuts if c.offset < n)
        if self.scan:
            o, new_state, taken = self._scan(qkvgb, None if starts_fresh else state_like, inside)
        else:
            init_state = ex.from_previous(state_like, self.layer, "kda_state", tag + 1) if ex.rank > 0 else (None if starts_fresh else state_like)
            o, new_state, taken = self._recurrence(qkvgb, init_state, inside)
            ex.to_next(new_state, tag + 1)
        if inside:
            windows = dict(zip(inside, conv_windows_at_cuts(qkv_TC, init_conv, [0, n], inside, a.conv_kernel - 1), strict=True))
            for cut, state in taken:
                cache.state_SHKV[cut.slot].copy_(state)
                cache.conv_SCW[cut.slot].copy_(windows[cut])
        for cut in self.cuts:
            if cut.offset == n:  # the cut is this shard's end: the state and window it hands on
                cache.state_SHKV[cut.slot].copy_(new_state[0])
                cache.conv_SCW[cut.slot].copy_(conv_state[0])
        cache.conv_SCW.index_copy_(0, slot, conv_state)
        cache.state_SHKV.index_copy_(0, slot, new_state)
        return a.o_proj(gated_output(o[0], gate_TP, a.o_norm).to(x_TD.dtype))

    def _recurrence(self, qkvgb: DeltaInputs, init_state: torch.Tensor | None, inside: tuple[StateCut, ...]) -> ShardRun:
        """The shard's recurrence over (q, k, v, g, beta) [T_r, ...] from `init_state` (None: zeros): (o [1, T_r, H, V'],
        end state [1, H, K, V'], the states at the cuts inside it), V' the width of v."""
        q, k, v, g, beta = qkvgb
        inputs, n = (q[None], k[None], v[None], g[None], beta[None]), q.shape[0]
        if inside:
            return prefill_with_cuts(self.inner.kda_prefill, inputs, init_state, [0, n], check_cuts(inside, [0, n]))
        o, state = self.inner.kda_prefill(*inputs, None, init_state, torch.tensor([0, n], device=q.device))
        return o, state, []

    def _scan(self, qkvgb: DeltaInputs, context_state: torch.Tensor | None, inside: tuple[StateCut, ...]) -> ShardRun:
        """`--kda-cp scan` (kda_scan.py): rank 0 runs from the sequence's start state (`context_state`, None: zeros),
        every other rank from [0 | I] over widened values; the scan's rounds give each rank its predecessors' composed
        map, from which it corrects its output, end state and cut states."""
        q, k, v, g, beta = qkvgb
        ex, heads, width, key = self.exchange, self.inner.num_heads, v.shape[-1], k.shape[-1]
        first = context_state if context_state is not None else q.new_zeros((1, heads, key, width), dtype=torch.float32)  # [1, H, K, V]
        if ex.rank == 0:
            o, end, taken = self._recurrence(qkvgb, first, inside)
            mine = Affine(None, end[0].float())
        else:
            o, end, taken = self._recurrence((q, k, widened(v, key), g, beta), identity_start(heads, key, width, q), inside)
            mine = Affine.of_widened(end, width)
        before = predecessors(mine, ex, self.layer, width)
        if before is None:  # rank 0
            return o, end, taken
        start = before.apply(first[0])
        fixed = [(cut, Affine.of_widened(state, width).apply(start).to(state.dtype)) for cut, state in taken]
        return corrected_output(o, start, width), mine.apply(start)[None].to(end.dtype), fixed
