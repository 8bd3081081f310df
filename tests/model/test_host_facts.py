"""HostFacts (model/batch.py): what the runner tells the model from its host lists equals what the model would read
back from the tensors, so giving them changes nothing but the host reads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from openk3.model.batch import ForwardBatch, HostFacts


@pytest.mark.parametrize(
    "contexts,slots",
    [([3], [7]), ([0, 4], [2, 3]), ([5, 6, 1], [4, 2, 3]), ([1, 1], [3, 3]), ([0, 0, 0], [0, 1, 2]), ([2, 9], [5, 4])],
)
def test_host_facts_equal_the_tensor_checks(contexts: list[int], slots: list[int]) -> None:
    table = torch.zeros(len(slots), 4, dtype=torch.int64)
    given = ForwardBatch.for_step([[1]] * len(slots), contexts, slots, table)
    assert given.host_facts == HostFacts.of(contexts, slots)
    read = dataclasses.replace(given, host_facts=None)
    assert given.slot_range == read.slot_range
    fresh, want = given.fresh_seqs, read.fresh_seqs
    if want is None:
        assert fresh is None
    else:
        assert fresh is not None and torch.equal(fresh, want)


def test_a_capturable_batch_decides_nothing_on_the_host() -> None:
    batch = ForwardBatch.for_step([[1], [2]], [3, 4], [0, 1], torch.zeros(2, 1, dtype=torch.int64))
    graph = dataclasses.replace(batch, capturable=True)
    assert batch.slot_range == (0, 2) and batch.fresh_seqs is None
    assert graph.slot_range is None and graph.fresh_seqs is not None and not bool(graph.fresh_seqs.any())
