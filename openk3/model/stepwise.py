"""A stepwise batch (ForwardBatch.stepwise): each sequence's few new tokens run one position after another through the
decode forms, so that a speculative verification of k drafts costs k + 1 decode steps of the KDA recurrence instead of a
chunked prefill, and leaves the KDA state after every verified position (issue 39).

Legend: T packed tokens, N sequences, C conv channels, P = H * K KDA width, S state slots.

Position p of the batch is the p-th new token of every sequence that has more than p of them. The KDA layers advance each
such sequence's slot by that token with the layer's decode step (ops/kda/decode_step.py, whichever form the layer chose),
then copy the state and conv window of the sequences cut after p + 1 tokens (state_cuts) into the cuts' slots: accepting
j < k drafts then installs exactly the state a plain decode of those tokens leaves, with no recomputation, and the slot
itself ends holding the state after all its tokens, as in any step. The projections, MLA, MoE and head still run over all
T rows at once; MLA attends each row over its sequence's pages up to its own position (the absorbed decode form with one
query row per token: the pages hold the step's latents before any row attends).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from openk3.ops.kda.decode_step import KDADecodeStep, KDALayerWeights, KDASlots


@dataclass(frozen=True)
class StepwisePosition:
    """The sequences that have a token at one position of the step."""

    rows: torch.Tensor  # [n] their rows of the packed batch
    slots: torch.Tensor  # [n] their state slots
    fresh: torch.Tensor | None  # [n] bool, sequences with no context yet (only at position 0; None: none)
    slot_range: tuple[int, int] | None  # (first, end) when `slots` are consecutive ascending ids
    cut_from: torch.Tensor | None  # slots whose state after this position is kept (state_cuts), or None
    cut_to: torch.Tensor | None  # the cuts' slots, in the same order


@dataclass(frozen=True)
class StepwisePlan:
    positions: tuple[StepwisePosition, ...]
    seq_of_row: torch.Tensor  # [T] the sequence of each packed row

    @staticmethod
    def of(cu: list[int], state_slots: torch.Tensor, fresh_N: torch.Tensor | None, cuts: Sequence[tuple[int, int, int]]) -> StepwisePlan:
        """The plan of a stepwise batch (model/batch.py's cu_seqlens on the host, state slots, fresh sequences and state
        cuts as (seq, offset, slot)); refuses a cut that is not strictly inside its sequence's tokens, or two at one place."""
        lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
        slots = [int(s) for s in state_slots.tolist()]
        kept: dict[int, list[tuple[int, int]]] = {}  # position -> (sequence's slot, cut slot)
        seen = set()
        for seq, offset, slot in cuts:
            if not 0 <= seq < len(lens) or not 0 < offset < lens[seq] or (seq, offset) in seen:
                raise ValueError(f"ForwardBatch.state_cuts: {(seq, offset, slot)} is not strictly inside a sequence of the step once (cu_seqlens {cu})")
            seen.add((seq, offset))
            kept.setdefault(offset - 1, []).append((slots[seq], slot))
        device = state_slots.device

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        positions = []
        for p in range(max(lens, default=0)):
            seqs = [i for i, n in enumerate(lens) if n > p]
            at = [slots[i] for i in seqs]
            consecutive = all(s == at[0] + j for j, s in enumerate(at))
            pairs = kept.get(p, [])
            positions.append(
                StepwisePosition(
                    rows=tensor([cu[i] + p for i in seqs]),
                    slots=tensor(at),
                    fresh=fresh_N[tensor(seqs)] if p == 0 and fresh_N is not None else None,
                    slot_range=(at[0], at[0] + len(at)) if consecutive else None,
                    cut_from=tensor([a for a, _ in pairs]) if pairs else None,
                    cut_to=tensor([b for _, b in pairs]) if pairs else None,
                )
            )
        seq_of_row = torch.repeat_interleave(torch.arange(len(lens), device=device), torch.tensor(lens, device=device), output_size=cu[-1])
        return StepwisePlan(tuple(positions), seq_of_row)


def kda_stepwise(
    step: KDADecodeStep,
    qkv_TC: torch.Tensor,
    f_TP: torch.Tensor,
    b_TH: torch.Tensor,
    gate_TP: torch.Tensor,
    weights: KDALayerWeights,
    state_SHKV: torch.Tensor,
    conv_SCW: torch.Tensor,
    plan: StepwisePlan,
) -> torch.Tensor:
    """o [T, P] fp32 of a KDA layer over a stepwise batch: the decode step `step` once per position, each advancing the
    slots of the sequences that have that position, the state cuts copied out after theirs (module docstring)."""
    o_TP: torch.Tensor | None = None
    for p in plan.positions:
        rows = p.rows
        slots = KDASlots(state_SHKV, conv_SCW, p.slots, p.fresh, p.slot_range)
        o = step(qkv_TC[rows], f_TP[rows], b_TH[rows], gate_TP[rows], weights, slots)
        if o_TP is None:
            o_TP = o.new_empty(qkv_TC.shape[0], o.shape[1])
        o_TP.index_copy_(0, rows, o)
        if p.cut_from is not None and p.cut_to is not None:
            state_SHKV.index_copy_(0, p.cut_to, state_SHKV.index_select(0, p.cut_from))
            conv_SCW.index_copy_(0, p.cut_to, conv_SCW.index_select(0, p.cut_from))
    assert o_TP is not None
    return o_TP
