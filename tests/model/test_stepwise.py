"""Stepwise batches (ForwardBatch.stepwise, model/stepwise.py), the speculative verification's forward: each row's logits
are those of decoding the sequence's tokens one at a time, the slot ends with the state after all of them, and the state
(and conv window) kept at each cut is the state a plain decode of exactly that prefix leaves."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from openk3.config import debug
from openk3.model import CacheTensors, ForwardBatch, K3ForCausalLM
from openk3.model.batch import StateCut
from openk3.model.kda import KimiDeltaAttention
from openk3.model.model import OpChoice
from openk3.model.stepwise import kda_stepwise
from openk3.ops.kda.decode_step import KDASlots
from openk3.serve.pack import PackedRow, pack

from .conftest import build
from .test_model import PAGE, TOL, pages_for

CONTEXT = [[7, 3, 9, 1, 4, 4, 8, 2, 6], [5, 1, 8, 8, 2], []]  # each sequence's tokens before the step (sequence 2 starts fresh)
NEW = [[11, 23, 5, 40], [17], [30, 2, 9]]  # a verification of 3 drafts, a plain decode row, a fresh 3-token sequence
SLOTS = [2, 0, 4]
CUTS = (StateCut(0, 1, 5), StateCut(0, 2, 6), StateCut(0, 3, 7), StateCut(2, 2, 8))
# The KDA recurrence is the same decode step either way (bit for bit: test_the_recurrence_is_the_plain_decode_step); what
# differs is the rounding of the layer inputs, which the other layers compute over 8 rows here and 1 there (GEMM vs GEMV,
# the MoE's grouped vs single-token path): measured up to 2e-6 on states of magnitude ~1-10.
STATE_TOL = 1e-5


@pytest.fixture(scope="module", params=["auto", "naive"])
def model(request: pytest.FixtureRequest) -> K3ForCausalLM:
    m = build(debug())
    m.select_ops(OpChoice(kda=request.param, mla=request.param))
    return m


def batch_of(tokens: list[list[int]], starts: list[int], slots: list[int], table: torch.Tensor) -> ForwardBatch:
    rows = [PackedRow(s, table[i].tolist(), c, t) for i, (t, c, s) in enumerate(zip(tokens, starts, slots, strict=True))]
    return pack(rows, torch.device("cpu"), list(range(sum(len(t) for t in tokens))))


def stepwise_step(model: K3ForCausalLM, cuts: tuple[StateCut, ...]) -> tuple[torch.Tensor, CacheTensors]:
    cache = CacheTensors.allocate(model.config, num_slots=10, num_pages=30, page_size=PAGE)
    for pool in (*cache.kda_state, *cache.conv_state):
        pool[4].normal_()  # the fresh sequence's slot holds garbage
    table = pages_for(3, 10)
    with torch.inference_mode():
        for i in (0, 1):
            model(batch_of([CONTEXT[i]], [0], [SLOTS[i]], table[i : i + 1]), cache)
        batch = batch_of(NEW, [len(c) for c in CONTEXT], SLOTS, table)
        logits = model(dataclasses.replace(batch, stepwise=True, state_cuts=cuts), cache)
    return logits, cache


def decoded_one_by_one(model: K3ForCausalLM, i: int) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """Sequence i's context then its new tokens decoded one per forward: the logits of each, the states after each."""
    cache = CacheTensors.allocate(model.config, num_slots=1, num_pages=10, page_size=PAGE)
    table = pages_for(1, 10)
    logits, states = [], []
    with torch.inference_mode():
        if CONTEXT[i]:
            model(batch_of([CONTEXT[i]], [0], [0], table), cache)
        for p, token in enumerate(NEW[i]):
            logits.append(model(batch_of([[token]], [len(CONTEXT[i]) + p], [0], table), cache))
            states.append([pool[0].clone() for pool in (*cache.kda_state, *cache.conv_state)])
    return torch.cat(logits), states


def test_rows_and_kept_states_equal_a_plain_decode(model: K3ForCausalLM) -> None:
    logits, cache = stepwise_step(model, CUTS)
    pools = (*cache.kda_state, *cache.conv_state)
    at = 0
    for i in range(3):
        ref_logits, ref_states = decoded_one_by_one(model, i)
        n = len(NEW[i])
        torch.testing.assert_close(logits[at : at + n], ref_logits, atol=TOL, rtol=0)
        at += n
        for pool, ref in zip(pools, ref_states[-1], strict=True):  # the sequence's slot: the state after all its tokens
            torch.testing.assert_close(pool[SLOTS[i]], ref, atol=STATE_TOL, rtol=0)
        for cut in (c for c in CUTS if c.seq == i):
            for pool, ref in zip(pools, ref_states[cut.offset - 1], strict=True):
                torch.testing.assert_close(pool[cut.slot], ref, atol=STATE_TOL, rtol=0)


def test_stepwise_logits_equal_the_chunked_step(model: K3ForCausalLM) -> None:
    stepwise, _ = stepwise_step(model, ())
    cache = CacheTensors.allocate(model.config, num_slots=10, num_pages=30, page_size=PAGE)
    table = pages_for(3, 10)
    with torch.inference_mode():
        for i in (0, 1):
            model(batch_of([CONTEXT[i]], [0], [SLOTS[i]], table[i : i + 1]), cache)
        chunked = model(batch_of(NEW, [len(c) for c in CONTEXT], SLOTS, table), cache)
    torch.testing.assert_close(stepwise, chunked, atol=TOL, rtol=0)


@pytest.mark.parametrize("cut", [StateCut(0, 0, 5), StateCut(0, 4, 5), StateCut(3, 1, 5)])
def test_a_cut_outside_its_sequence_is_refused(model: K3ForCausalLM, cut: StateCut) -> None:
    with pytest.raises(ValueError, match="state_cuts"):
        stepwise_step(model, (cut,))


def test_a_decode_batch_is_not_stepwise() -> None:
    batch = ForwardBatch.for_step([[1], [2]], [3, 4], [0, 1], pages_for(2, 2))
    with pytest.raises(ValueError, match="stepwise"):
        dataclasses.replace(batch, stepwise=True)


def test_the_recurrence_is_the_plain_decode_step(model: K3ForCausalLM) -> None:
    """Given the same projections, the stepwise KDA is the layer's decode step called once per position, bit for bit."""
    layer = next(m for m in model.modules() if isinstance(m, KimiDeltaAttention))
    cfg = model.config.kda
    g = torch.Generator().manual_seed(3)
    t, p = sum(len(x) for x in NEW), cfg.proj_dim
    qkv, f, b, gate = (torch.randn(t, w, generator=g) for w in (3 * p, p, cfg.num_heads, p))
    cache = CacheTensors.allocate(model.config, num_slots=10, num_pages=30, page_size=PAGE)
    for pool in (*cache.kda_state, *cache.conv_state):
        pool.normal_(generator=g)
    plain = [pool.clone() for pool in (cache.kda_state[0], cache.conv_state[0])]
    batch = dataclasses.replace(batch_of(NEW, [len(c) for c in CONTEXT], SLOTS, pages_for(3, 10)), stepwise=True, state_cuts=CUTS)
    weights = layer.layer_weights()
    with torch.inference_mode():
        o = kda_stepwise(layer.kda_decode, qkv, f, b, gate, weights, cache.kda_state[0], cache.conv_state[0], batch.stepwise_plan)
        at = 0
        for i, tokens in enumerate(NEW):
            fresh = torch.tensor([not CONTEXT[i]])
            for j in range(len(tokens)):
                r = slice(at + j, at + j + 1)
                slots = KDASlots(plain[0], plain[1], torch.tensor([SLOTS[i]]), fresh if j == 0 and not CONTEXT[i] else None, None)
                assert torch.equal(layer.kda_decode(qkv[r], f[r], b[r], gate[r], weights, slots), o[r])
                for cut in (c for c in CUTS if c.seq == i and c.offset == j + 1):
                    assert torch.equal(cache.kda_state[0][cut.slot], plain[0][SLOTS[i]])
                    assert torch.equal(cache.conv_state[0][cut.slot], plain[1][SLOTS[i]])
            at += len(tokens)
    assert torch.equal(cache.kda_state[0][SLOTS], plain[0][SLOTS])
    assert torch.equal(cache.conv_state[0][SLOTS], plain[1][SLOTS])
