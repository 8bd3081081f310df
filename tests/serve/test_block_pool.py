import pytest

from openk3.serve.cache.block_pool import BlockPool
from openk3.serve.cache.state_pool import StatePool


def test_block_ids_are_exact_and_fifo() -> None:
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    pool.free([3, 2])
    assert pool.num_free == 3
    assert pool.allocate(3) == [5, 3, 2]  # front of the queue first, freed blocks at its back in the order given
    assert pool.allocate(1) is None
    assert pool.num_free == 0
    pool.check_integrity()


def test_all_or_nothing_allocation() -> None:
    pool = BlockPool(3)
    assert pool.allocate(4) is None
    assert pool.num_free == 3
    assert pool.allocate(0) == []
    pool.check_integrity()


def test_ref_counts_free_on_last_holder() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    assert blocks is not None
    pool.share(blocks)
    assert [pool.ref_count(b) for b in blocks] == [2, 2]
    pool.free(blocks)
    assert pool.num_free == 2 and pool.ref_count(0) == 1
    pool.free(blocks[::-1])
    assert pool.num_free == 4
    assert pool.allocate(4) == [2, 3, 1, 0]
    pool.check_integrity()


def test_double_free_and_bad_share_are_refused() -> None:
    pool = BlockPool(2)
    b = pool.allocate(1)
    assert b is not None
    pool.free(b)
    with pytest.raises(ValueError, match="double free"):
        pool.free(b)
    with pytest.raises(ValueError, match="free"):
        pool.share([1])
    with pytest.raises(ValueError, match="out of range"):
        pool.free([7])
    pool.check_integrity()


def test_integrity_catches_corruption() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    pool._ref[0] = 0  # a held block whose count was lost
    with pytest.raises(AssertionError, match="neither free nor held"):
        pool.check_integrity()


def test_state_pool_slots() -> None:
    pool = StatePool(3)
    assert [pool.allocate(), pool.allocate()] == [0, 1]
    pool.free(0)
    assert [pool.allocate(), pool.allocate()] == [2, 0]
    assert pool.allocate() is None
    with pytest.raises(ValueError, match="double free"):
        pool.free(1)
        pool.free(1)
    pool.check_integrity()
    pool._held[2] = False
    with pytest.raises(AssertionError, match="slot 2"):
        pool.check_integrity()


def test_pool_sizes_validated() -> None:
    with pytest.raises(ValueError, match="num_slots"):
        StatePool(0)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(-1)
