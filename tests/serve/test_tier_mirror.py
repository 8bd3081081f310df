"""TierMirror (serve/cache/tier_mirror.py): a TP rank repeats rank 0's host tier on its own pools -- a pack keeps its own
prefix under the key, a load writes it back, a drop takes effect only at the next step (a load in the same step's
copies still finds the entry), and an entry offloaded again after a drop in the same step survives it."""

from __future__ import annotations

import pytest
import torch

from openk3.config import debug
from openk3.model.batch import CacheTensors, MirrorDrop, MirrorLoad, MirrorPack
from openk3.serve.cache.tier_mirror import TierMirror
from openk3.serve.cache.transfer import replay


def pools() -> CacheTensors:
    cache = CacheTensors.allocate(debug(), num_slots=3, num_pages=6, page_size=4)
    g = torch.Generator().manual_seed(1)
    for t in cache.pools():
        t.copy_(torch.randn(t.shape, generator=g))
    return cache


def same_prefix(cache: CacheTensors, a: tuple[int, tuple[int, ...]], b: tuple[int, tuple[int, ...]], tokens: int) -> bool:
    (slot_a, pages_a), (slot_b, pages_b) = a, b
    states = all(torch.equal(p[slot_a], p[slot_b]) for p in (*cache.kda_state, *cache.conv_state))
    latents = all(torch.equal(torch.cat([p[i] for i in pages_a])[:tokens], torch.cat([p[i] for i in pages_b])[:tokens]) for p in cache.mla_latent)
    return states and latents


def test_pack_then_load_restores_this_ranks_own_prefix() -> None:
    cache, mirror = pools(), TierMirror()
    replay(cache, [MirrorPack(b"k", 0, (1, 2), 6), MirrorLoad(b"k", 2, (4, 5), 6)], mirror)
    assert same_prefix(cache, (0, (1, 2)), (2, (4, 5)), 6)
    assert mirror.nbytes > 0


def test_a_drop_waits_for_the_next_step() -> None:
    cache, mirror = pools(), TierMirror()
    replay(cache, [MirrorPack(b"k", 0, (1, 2), 6), MirrorDrop(b"k"), MirrorLoad(b"k", 2, (4, 5), 6)], mirror)
    assert same_prefix(cache, (0, (1, 2)), (2, (4, 5)), 6), "loaded after its drop, before the step"
    mirror.step()
    assert mirror.entries == {}
    with pytest.raises(RuntimeError, match="never packed"):
        replay(cache, [MirrorLoad(b"k", 2, (4, 5), 6)], mirror)


def test_an_entry_offloaded_again_after_its_drop_survives_the_step() -> None:
    cache, mirror = pools(), TierMirror()
    replay(cache, [MirrorPack(b"k", 0, (1, 2), 6), MirrorDrop(b"k"), MirrorPack(b"k", 1, (3, 0), 6)], mirror)
    mirror.step()
    assert b"k" in mirror.entries


def test_mirror_ops_need_a_mirror() -> None:
    with pytest.raises(ValueError, match="without a tier mirror"):
        replay(pools(), [MirrorDrop(b"k")])
