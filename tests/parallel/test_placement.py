"""EPLB-style placement: replication order, balanced packing, placement tables, replica routing, the load collector, and the
fixed-shape counting that keeps routing on the device."""

from __future__ import annotations

import pytest
import torch

from openk3.parallel.ep.placement import (
    LoadCollector,
    Placement,
    balanced_pack,
    contiguous_placement,
    counts_per_id,
    eplb_placement,
    first_of_sorted,
    redundant_for,
    replicate,
)


def test_replicate_adds_to_largest_load_per_replica() -> None:
    assert replicate(torch.tensor([10.0, 1, 1, 1]), 6).tolist() == [3, 1, 1, 1]
    # 10 -> 5 per replica after one extra, so the second extra goes to the expert with 6.
    assert replicate(torch.tensor([10.0, 6]), 4).tolist() == [2, 2]
    with pytest.raises(ValueError, match="num_physical=1 is below num_experts=2"):
        replicate(torch.tensor([1.0, 1.0]), 1)


def test_balanced_pack_fills_lightest_pack_with_room() -> None:
    weights = torch.tensor([5.0, 4, 3, 3, 2, 1])
    pack = balanced_pack(weights, 2)
    assert torch.bincount(pack).tolist() == [3, 3]
    assert [float(weights[pack == p].sum()) for p in range(2)] == [9.0, 9.0]
    assert pack.tolist() == [0, 1, 1, 0, 1, 0]
    with pytest.raises(ValueError, match="num_packs=4"):
        balanced_pack(weights, 4)


def test_eplb_placement_is_a_valid_table_and_beats_contiguous_on_skew() -> None:
    load = torch.arange(1, 17).float().pow(-1.5) * 1000
    placement = eplb_placement(load, num_ranks=4, num_redundant=4)
    assert placement.phys_to_log.shape == (4, 5)
    counts = placement.replica_counts()
    assert int(counts.sum()) == 20 and int(counts.min()) >= 1 and int(counts[0]) > 1
    assert torch.equal(torch.bincount(placement.phys_to_log.reshape(-1), minlength=16), counts)
    per_rank = (load / counts)[placement.phys_to_log].sum(1)
    plain = load.view(4, 4).sum(1)
    assert float(per_rank.max() / per_rank.mean()) < float(plain.max() / plain.mean())
    with pytest.raises(ValueError, match="must be a multiple of num_ranks=4"):
        eplb_placement(load, num_ranks=4, num_redundant=3)


def test_route_splits_each_expert_evenly_over_its_replicas() -> None:
    placement = Placement.from_table(torch.tensor([[0, 1], [0, 2], [0, 3]]), 4)
    idx = torch.tensor([[0, 1]] * 7 + [[2, 0]] * 5)
    for salt in range(3):
        phys = placement.route(idx, salt)
        assert torch.equal(placement.phys_to_log.reshape(-1)[phys], idx)
        replicas = torch.bincount(phys[idx == 0], minlength=6)[[0, 2, 4]]
        assert int(replicas.max() - replicas.min()) <= 1 and int(replicas.sum()) == 12


def test_contiguous_and_errors() -> None:
    assert contiguous_placement(6, 3).phys_to_log.tolist() == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="num_experts=10 must be a multiple of num_ranks=4"):
        contiguous_placement(10, 4)
    with pytest.raises(ValueError, match=r"experts \[3\] have no replica"):
        Placement.from_table(torch.tensor([[0, 1], [2, 2]]), 4)


def test_redundant_for_rounds_up_to_equal_ranks() -> None:
    assert redundant_for(896, 64, 0.1) == 128  # 986 -> 1024 = 16 per rank
    assert redundant_for(896, 8, 0.1) == 96  # 986 -> 992
    assert redundant_for(8, 4, 0.0) == 0


def test_load_collector_keeps_a_window() -> None:
    collector = LoadCollector(num_experts=4, window=2)
    for step in range(3):
        collector.observe(5, torch.tensor([[step, 3]]))
    assert collector.layers() == [5]
    assert collector.load(5).tolist() == [0, 1, 1, 2]  # steps 1 and 2 only
    assert collector.load(7).tolist() == [0, 0, 0, 0]
    assert collector.placements(2, 0)[5].phys_to_log.shape == (2, 2)
    with pytest.raises(ValueError, match="window=0"):
        LoadCollector(4, 0)


def test_device_counting_matches_bincount_and_run_starts() -> None:
    ids = torch.tensor([3, 0, 3, 3, 1, 0])
    assert torch.equal(counts_per_id(ids, 5), torch.bincount(ids, minlength=5))
    assert counts_per_id(torch.zeros(0, dtype=torch.int64), 3).tolist() == [0, 0, 0]
    sorted_ids = torch.sort(ids).values  # [0, 0, 1, 3, 3, 3]
    assert first_of_sorted(sorted_ids, 5).tolist() == [0, 0, 2, 3, 3, 3]


def test_route_is_the_same_with_tables_moved() -> None:
    placement = eplb_placement(torch.tensor([9.0, 1, 1, 1]), num_ranks=2, num_redundant=2)
    idx = torch.tensor([[0, 1], [0, 2], [3, 0], [0, 1]])
    moved = placement.to(torch.device("cpu"))
    for salt in range(2):
        assert torch.equal(moved.route(idx, salt), placement.route(idx, salt))


def test_load_collector_counts_steps_inside_the_window() -> None:
    collector = LoadCollector(4, window=2)
    assert collector.steps(1) == 0
    for _ in range(3):
        collector.observe(1, torch.tensor([[0, 1]]))
    assert collector.steps(1) == 2
