import pytest
import torch

from openk3.config import debug
from openk3.serve.cache.manager import CacheManager
from openk3.serve.cache.spec import CacheSpec


def test_allocate_grows_pages_and_frees_everything() -> None:
    cm = CacheManager(debug(), num_pages=5, page_size=4, num_slots=2)
    assert cm.allocate("a", 5) == [0, 1]
    assert cm.allocate("a", 8) == []
    assert cm.allocate("a", 9) == [2]
    assert cm.slot("a") == 0 and cm.page_ids("a") == [0, 1, 2]
    assert cm.allocate("b", 12) is None  # 3 pages wanted, 2 free: nothing taken
    assert not cm.holds("b") and cm.num_free_slots == 1
    assert cm.allocate("b", 8) == [3, 4]
    assert cm.allocate("c", 1) is None  # no slot and no page left
    cm.check_integrity()
    cm.free("a")
    assert cm.num_free_pages == 3 and cm.num_free_slots == 1
    assert cm.allocate("c", 1) == [2]  # a's pages came back last page first
    cm.free("b")
    cm.free("c")
    assert cm.num_free_pages == 5 and cm.num_free_slots == 2
    cm.check_integrity()


def test_integrity_catches_a_page_held_twice() -> None:
    cm = CacheManager(debug(), num_pages=4, page_size=4, num_slots=2)
    cm.allocate("a", 4)
    cm.allocate("b", 4)
    cm._pages["b"].append(cm._pages["a"][0])
    with pytest.raises(AssertionError, match="page 0"):
        cm.check_integrity()


def test_pages_for_memory_match_cache_spec_and_tensors() -> None:
    cfg = debug()
    spec = CacheSpec.from_config(cfg, 16, cache_dtype_bytes=4)
    budget = 8 * spec.kda.bytes_per_sequence + 100 * spec.mla.bytes_per_page + 7
    n = CacheManager.num_pages_for_memory(cfg, budget, 16, 8, torch.float32)
    assert n == 100
    cm = CacheManager(cfg, n, 16, 8)
    allocated = sum(t.numel() * t.element_size() for t in cm.tensors.kda_state + cm.tensors.conv_state + cm.tensors.mla_latent)
    assert allocated == 8 * spec.kda.bytes_per_sequence + 100 * spec.mla.bytes_per_page
    with pytest.raises(ValueError, match="too small"):
        CacheManager.num_pages_for_memory(cfg, 8 * spec.kda.bytes_per_sequence, 16, 8, torch.float32)
