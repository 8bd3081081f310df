"""KDA prefill that also hands out the state at cuts inside a step's sequences (ForwardBatch.state_cuts): the prefix cache
snapshots a prompt at its match-unit boundaries without cutting the engine step there, so the projections, MLA and MoE
still run over the whole step at once and only the delta rule runs piece by piece.

Legend: T packed tokens of the step, N sequences, H heads, K = V = head dim, C conv channels, W conv kernel, R rows of a round.

A sequence with cuts at offsets o_1 < ... < o_m is run as m + 1 pieces [0, o_1), [o_1, o_2), ..., [o_m, len); round r runs
piece r of every sequence that has one, in one varlen call, from the state round r - 1 ended with. The state a piece ends
with is the state at the next cut: it is what the chunkwise op computes at that position anyway, so a cut costs the
gathers of one more call, not more arithmetic. The conv window at a cut needs no rerun: it is the last W - 1 pre-conv inputs
before the cut (from the slot's window where the cut is closer than W - 1 to the step's start).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from openk3.model.batch import StateCut

KDAPrefill = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # ops/kda/naive.py's kda_recurrent signature


def check_cuts(cuts: Sequence[StateCut], cu: Sequence[int]) -> dict[int, list[StateCut]]:
    """The cuts per sequence, ascending by offset; each must lie strictly inside its sequence's tokens, once."""
    per_seq: dict[int, list[StateCut]] = {}
    for cut in cuts:
        if not 0 <= cut.seq < len(cu) - 1 or not 0 < cut.offset < cu[cut.seq + 1] - cu[cut.seq]:
            raise ValueError(f"ForwardBatch.state_cuts: {cut} is not strictly inside a sequence of the step (cu_seqlens {list(cu)})")
        per_seq.setdefault(cut.seq, []).append(cut)
    for seq_cuts in per_seq.values():
        seq_cuts.sort(key=lambda c: c.offset)
        offsets = [c.offset for c in seq_cuts]
        if len(set(offsets)) != len(offsets):
            raise ValueError(f"ForwardBatch.state_cuts: two cuts at one offset of sequence {seq_cuts[0].seq}: {offsets}")
    return per_seq


def conv_windows_at_cuts(
    qkv_TC: torch.Tensor, init_conv_NCW: torch.Tensor | None, cu: Sequence[int], cuts: Sequence[StateCut], width: int
) -> list[torch.Tensor]:
    """The conv window [C, W - 1] (pre-conv inputs, oldest first) after each cut, in `cuts` order."""
    out = []
    for cut in cuts:
        start = cu[cut.seq]
        new = qkv_TC[max(start, start + cut.offset - width) : start + cut.offset].t()  # [C, <= W - 1]
        if new.shape[1] < width:
            old = init_conv_NCW[cut.seq] if init_conv_NCW is not None else qkv_TC.new_zeros(qkv_TC.shape[1], width)
            new = torch.cat((old.to(new.dtype), new), dim=1)[:, -width:]
        out.append(new)
    return out


def prefill_with_cuts(
    prefill: KDAPrefill,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    init_state_NHKV: torch.Tensor | None,
    cu: Sequence[int],
    per_seq: dict[int, list[StateCut]],
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[StateCut, torch.Tensor]]]:
    """(o [1, T, H, V], final states [N, H, K, V], [(cut, state [H, K, V])]) of the delta rule over q, k, v, g, beta
    ([1, T, ...] each), with the state after every cut."""
    q = inputs[0]
    n_seqs = len(cu) - 1
    bounds = [[0, *(c.offset for c in per_seq.get(i, [])), cu[i + 1] - cu[i]] for i in range(n_seqs)]
    o: torch.Tensor | None = None
    states = init_state_NHKV  # [N, H, K, V] of every sequence after the previous round (None: zeros, before round 0)
    taken: list[tuple[StateCut, torch.Tensor]] = []
    for r in range(max(len(b) - 1 for b in bounds)):
        seqs = [i for i in range(n_seqs) if len(bounds[i]) - 1 > r]
        spans = [(cu[i] + bounds[i][r], cu[i] + bounds[i][r + 1]) for i in seqs]
        rows = torch.cat([torch.arange(a, b, device=q.device) for a, b in spans])
        lens = [0] + [b - a for a, b in spans]
        round_cu = torch.tensor(lens, dtype=torch.int64).cumsum(0).to(q.device)
        init = None if states is None else states if r == 0 else states[seqs]
        o_r, final_r = prefill(*(t.index_select(1, rows) for t in inputs), None, init, round_cu)
        if o is None:
            o = o_r.new_empty(*q.shape[:3], o_r.shape[-1])
        o.index_copy_(1, rows, o_r)
        states = final_r if r == 0 else states.index_copy(0, torch.tensor(seqs, device=q.device), final_r)  # type: ignore[union-attr]
        for j, i in enumerate(seqs):
            if r < len(bounds[i]) - 2:
                taken.append((per_seq[i][r], final_r[j]))
    assert o is not None and states is not None
    return o, states, taken
