"""The exchange in few collectives: typed fields in one byte buffer per destination (wire), the counted collectives and
host reads per MoE layer, the fixed-capacity exchange equal to the exact one when nothing drops, and expert load summed
over data-parallel ranks and placed from a file."""

from __future__ import annotations

import pytest
import torch

from openk3.parallel.ep.padded import Capacity
from openk3.parallel.ep.wire import ALIGN, Field, field_of, pack, segment_bytes, unpack
from openk3.parallel.launch import run_ranks
from tests.parallel.ep_cases import exchange_cases


def test_wire_round_trip_keeps_every_field_bitwise() -> None:
    g = torch.Generator().manual_seed(0)
    meta = torch.randint(-(2**40), 2**40, (7, 3), generator=g)
    weight = torch.rand(7, generator=g)
    rows = torch.randn(5, 3, generator=g).to(torch.bfloat16)  # 6 bytes a row: segments need padding
    counts = [[3, 0, 4], [3, 0, 4], [1, 0, 4]]
    buffer = pack([meta, weight, rows], counts)
    kinds = [field_of(t) for t in (meta, weight, rows)]
    sizes = segment_bytes(kinds, counts)
    assert all(s % ALIGN == 0 for s in sizes) and buffer.numel() == sum(sizes) and sizes[1] == 0
    parts = unpack(buffer, kinds, counts)
    for f, whole in enumerate((meta, weight, rows)):
        assert torch.equal(torch.cat(parts[f]), whole)
    assert parts[2][0].data_ptr() >= buffer.data_ptr()  # views into the buffer, not copies


def test_wire_refuses_bad_order_and_short_buffers() -> None:
    with pytest.raises(ValueError, match="descending element size"):
        pack([torch.zeros(1, dtype=torch.float32), torch.zeros(1, dtype=torch.int64)], [[1], [1]])
    with pytest.raises(ValueError, match="per-rank counts sum to 3"):
        pack([torch.zeros(2, dtype=torch.int64)], [[1, 2]])
    with pytest.raises(ValueError, match="received 8 bytes, the counts describe 16"):
        unpack(torch.zeros(8, dtype=torch.uint8), [Field(torch.int64, ())], [[2]])


def test_capacity_slots_and_validation() -> None:
    assert Capacity(1.25, 8).slots(k=3, num_physical=16) == 2  # ceil(1.25 * 8 * 3 / 16)
    assert Capacity(100.0, 8).slots(k=3, num_physical=16) == 8  # never more than max_tokens
    with pytest.raises(ValueError, match="factor=0"):
        Capacity(0, 8)
    with pytest.raises(ValueError, match="max_tokens=0"):
        Capacity(1.0, 0)


@pytest.fixture(scope="module")
def results() -> list[dict[str, float]]:
    return run_ranks(exchange_cases, 2)


# Per layer, stats off: exact = counts + payload + combine (one host read of the counts); fixed capacity = payload +
# combine (no host read); MoonEP adds the count all-gather and the prefetch (host reads: the prefetch split sizes with the
# grouped layout, and the exchange's counts; the planner and the slot check run on the device).
EXPECTED = {"ep": (3, 1), "eplb": (3, 1), "padded": (2, 0), "padded_eplb": (2, 0), "moonep": (5, 2)}


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_collectives_and_host_reads_per_layer(results, name: str) -> None:
    collectives, host_reads = EXPECTED[name]
    for out in results:
        assert out[f"{name}/collectives"] == collectives
        assert out[f"{name}/real_collectives"] == collectives  # what torch.distributed saw, with stats off
        assert out[f"{name}/host_reads"] == host_reads
        assert out[f"{name}/error"] <= 1e-5


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["padded", "padded_eplb"])
def test_fixed_capacity_equals_exact_when_nothing_drops(results, name: str) -> None:
    for out in results:
        assert out[f"{name}/dropped"] == 0
        assert out[f"{name}/vs_exact"] <= 1e-6


@pytest.mark.distributed
def test_fixed_capacity_drops_beyond_capacity_as_zero(results) -> None:
    assert sum(out["tight/dropped"] for out in results) > 0
    for out in results:
        assert out["tight/dropped"] == out["tight/expected_dropped"]
        assert out["tight/error"] <= 1e-5


@pytest.mark.distributed
def test_gathered_load_is_the_sum_over_ranks(results) -> None:
    for rank, out in enumerate(results):
        assert sum(out[f"load/local/{e}"] for e in range(4)) == (6 + 3 * rank) * 3  # T x k entries of this rank
    for e in range(4):
        total = sum(out[f"load/local/{e}"] for out in results)
        assert all(out[f"load/gathered/{e}"] == total for out in results)


@pytest.mark.distributed
def test_eplb_from_a_load_file_matches_single_process(results) -> None:
    for out in results:
        assert out["eplb_file/error"] <= 1e-5
        assert out["eplb_file/hot_replicas"] == 2  # zipf routing: expert 0 is hottest; 2 ranks cap it at 2 replicas


@pytest.mark.distributed
@pytest.mark.parametrize("feed", ["replicated", "dp"])
def test_fixed_capacity_greedy_decode_matches_single_process(results, feed: str) -> None:
    for out in results:
        assert out[f"padded_greedy_{feed}"] <= 1e-5
        assert out[f"padded_greedy_{feed}/mismatched_tokens"] == 0
        assert out[f"padded_greedy_{feed}/observed_entries"] > 0
