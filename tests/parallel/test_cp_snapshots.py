"""Prefix-cache snapshots inside a context-parallel prefill step (ForwardBatch.state_cuts under CP): every rank's slots,
the sequence's own and each cut's, hold what one process leaves there when it prefills the same shards as chunks with the
same cuts (a cut inside a shard, on a shard boundary, after a context) -- on 2 and 3 gloo ranks; bad cuts are refused."""

from __future__ import annotations

import pytest
import torch

from openk3.config import debug
from openk3.model.batch import StateCut
from openk3.parallel.cp.exchange import shard_bounds
from openk3.parallel.cp.prefill import context_parallel_prefill, cut_owners
from openk3.parallel.group import ParallelContext
from openk3.parallel.launch import run_ranks
from tests.model.conftest import build
from tests.parallel.cp_cases import SLOT, cut_case, cut_cases, new_cache, prompt


def test_a_cut_belongs_to_the_shard_that_holds_its_last_token() -> None:
    shards = shard_bounds(10, 2)  # [0, 5), [5, 10)
    assert cut_owners([StateCut(0, o, 0) for o in (1, 4, 5, 6, 9)], shards) == [0, 0, 0, 1, 1]
    for offset in (0, 10):
        with pytest.raises(ValueError, match="not strictly inside"):
            cut_owners([StateCut(0, offset, 0)], shards)


def test_cut_slots_that_clash_are_refused_by_name() -> None:
    model = build(debug())
    cache, pages = new_cache(model, 20)
    with pytest.raises(ValueError, match=r"slots \[1\] must differ"):
        context_parallel_prefill(model, ParallelContext.single(), prompt(20, 0), cache, SLOT, pages, cuts=[StateCut(0, 5, SLOT)])
    with pytest.raises(ValueError, match="slot=7, expected"):
        context_parallel_prefill(model, ParallelContext.single(), prompt(20, 0), cache, SLOT, pages, cuts=[StateCut(0, 5, 7)])


def test_one_rank_takes_the_cuts_as_one_process_does() -> None:
    e = cut_case(ParallelContext.single(), 30, (4, 17))
    assert e["kda_state"] <= 1e-6 and e["conv_state"] <= 1e-6 and e["cut_slots_filled"] == 1 and e["cut_bytes"] == 0


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_cut_states_on_every_rank_equal_one_process(world: int) -> None:
    torch.set_num_threads(1)
    cfg = debug()
    n_kda = cfg.num_hidden_layers - len(cfg.mla_layers)
    slot_bytes = 4 * (cfg.kda.num_heads * cfg.kda.head_dim**2 + 3 * cfg.kda.proj_dim * (cfg.kda.conv_kernel - 1))
    results = run_ranks(cut_cases, world)
    for rank, by_case in enumerate(results):
        for case, e in by_case.items():
            assert e["kda_state"] <= 1e-6 and e["conv_state"] <= 1e-6, f"rank {rank}, {case}: {e}"
            assert e["cut_slots_filled"] == 1, f"rank {rank}, {case}"
    # each rank receives the cuts other ranks took: state + window of every KDA layer per cut
    t = 40 - 40 % world
    owners = cut_owners([StateCut(0, o, 0) for o in (3, t // world, t - 2)], shard_bounds(t, world))
    for rank, by_case in enumerate(results):
        assert by_case["fresh"]["cut_bytes"] == sum(r != rank for r in owners) * n_kda * slot_bytes
