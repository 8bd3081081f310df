"""State cuts inside a prefill step (ForwardBatch.state_cuts, model/kda_cuts.py): the step's logits and final states are
those of the same step without cuts, and the state (and conv window) written at each cut is the state of a forward that
ends exactly there."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from openk3.model import CacheTensors, ForwardBatch, K3ForCausalLM
from openk3.model.batch import StateCut

from .test_model import PAGE, TOL, pages_for

PREFIX = [7, 3, 9, 1, 4, 4, 8, 2, 6]  # sequence 0's context before the step
SEQS = [[(5 * i + 3) % 97 for i in range(23)], [(11 * i + 1) % 89 for i in range(13)]]
CUTS = (StateCut(0, 1, 5), StateCut(0, 8, 6), StateCut(0, 16, 7), StateCut(1, 2, 8), StateCut(1, 12, 9))
SLOTS = [2, 0]


def step(model: K3ForCausalLM, cuts: tuple[StateCut, ...]) -> tuple[torch.Tensor, CacheTensors]:
    """Sequence 0 continues after PREFIX in slot 2, sequence 1 starts fresh in slot 0 (which holds garbage)."""
    cache = CacheTensors.allocate(model.config, num_slots=10, num_pages=24, page_size=PAGE)
    table = pages_for(2, 12)
    for pool in (*cache.kda_state, *cache.conv_state):
        pool[0].normal_()
    with torch.inference_mode():
        model(ForwardBatch.for_step([PREFIX], [0], [2], table[:1]), cache)
        batch = ForwardBatch.for_step(SEQS, [len(PREFIX), 0], SLOTS, table, only_last_logits=False)
        logits = model(dataclasses.replace(batch, state_cuts=cuts), cache)
    return logits, cache


def state_after(model: K3ForCausalLM, tokens: list[int], context: list[int]) -> CacheTensors:
    cache = CacheTensors.allocate(model.config, num_slots=1, num_pages=12, page_size=PAGE)
    table = pages_for(1, 12)
    with torch.inference_mode():
        if context:
            model(ForwardBatch.for_step([context], [0], [0], table), cache)
        model(ForwardBatch.for_step([tokens], [len(context)], [0], table), cache)
    return cache


def test_cuts_leave_the_step_unchanged_and_write_the_states_at_the_cuts(debug_model: K3ForCausalLM) -> None:
    plain_logits, plain = step(debug_model, ())
    cut_logits, cut = step(debug_model, CUTS)
    torch.testing.assert_close(cut_logits, plain_logits, atol=TOL, rtol=0)
    for a, b in zip(cut.kda_state + cut.conv_state, plain.kda_state + plain.conv_state, strict=True):
        torch.testing.assert_close(a[SLOTS], b[SLOTS], atol=1e-5, rtol=0)
    for c in CUTS:
        ref = state_after(debug_model, SEQS[c.seq][: c.offset], PREFIX if c.seq == 0 else [])
        # the reference computes the layer inputs in another batch shape: equal up to fp32 rounding, not bit for bit
        for a, b in zip(cut.kda_state + cut.conv_state, ref.kda_state + ref.conv_state, strict=True):
            torch.testing.assert_close(a[c.slot], b[0], atol=TOL, rtol=0)


@pytest.mark.parametrize("cut", [StateCut(0, 0, 5), StateCut(0, 23, 5), StateCut(2, 1, 5)])
def test_a_cut_outside_its_sequence_is_refused(debug_model: K3ForCausalLM, cut: StateCut) -> None:
    with pytest.raises(ValueError, match="state_cuts"):
        step(debug_model, (cut,))


def test_a_decode_batch_takes_no_cuts() -> None:
    batch = ForwardBatch.for_step([[1], [2]], [3, 4], [0, 1], pages_for(2, 2))
    with pytest.raises(ValueError, match="state_cuts"):
        dataclasses.replace(batch, state_cuts=(StateCut(0, 1, 2),))
