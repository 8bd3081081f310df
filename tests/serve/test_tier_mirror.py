"""TierMirror (serve/cache/tier_mirror.py): a TP rank repeats rank 0's host tier on its own pools -- a pack keeps its own
prefix under the key, a load writes it back, a drop takes effect only at the next step (a load in the same step's
copies still finds the entry), and an entry offloaded again after a drop in the same step survives it. Spilled entries
live in files of the rank's own (its disk tier under the same folder), loaded and dropped the same way; the prefix
cache logs the spills and drops of rank 0's tiers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from openk3.config import debug
from openk3.model.batch import CacheTensors, MirrorDrop, MirrorLoad, MirrorPack, MirrorSpill
from openk3.serve.cache import tier_record
from openk3.serve.cache.block_pool import BlockPool
from openk3.serve.cache.disk_tier import DiskTier
from openk3.serve.cache.hashing import snapshot_key
from openk3.serve.cache.prefix import PrefixCache
from openk3.serve.cache.tier_mirror import TierMirror
from openk3.serve.cache.tier_types import TierEntry
from openk3.serve.cache.tiers import HostTier, TierStack
from openk3.serve.cache.transfer import buffer_nbytes, replay


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
    with pytest.raises(RuntimeError, match="does not hold"):
        replay(cache, [MirrorLoad(b"k", 2, (4, 5), 6)], mirror)


def test_an_entry_offloaded_again_after_its_drop_survives_the_step() -> None:
    cache, mirror = pools(), TierMirror()
    replay(cache, [MirrorPack(b"k", 0, (1, 2), 6), MirrorDrop(b"k"), MirrorPack(b"k", 1, (3, 0), 6)], mirror)
    mirror.step()
    assert b"k" in mirror.entries


def test_mirror_ops_need_a_mirror() -> None:
    with pytest.raises(ValueError, match="without a tier mirror"):
        replay(pools(), [MirrorDrop(b"k")])


def test_a_spilled_entry_is_loaded_from_this_ranks_own_file_and_dropped_with_it(tmp_path: Path) -> None:
    cache, mirror = pools(), TierMirror(str(tmp_path))
    key = snapshot_key(b"anchor", (7, 8))  # the record's header is checked on load: key, anchor and tail must agree
    replay(cache, [MirrorPack(key, 0, (1, 2), 6), MirrorSpill(key, b"anchor", (7, 8), 6)], mirror)
    assert mirror.entries == {} and mirror.disk is not None
    mirror.disk.flush()
    assert len(os.listdir(mirror.disk.dir)) == 1
    replay(cache, [MirrorLoad(key, 2, (4, 5), 6)], mirror)
    assert same_prefix(cache, (0, (1, 2)), (2, (4, 5)), 6)
    replay(cache, [MirrorDrop(key), MirrorLoad(key, 1, (3, 0), 6)], mirror)  # still there until the step
    mirror.step()
    assert os.listdir(mirror.disk.dir) == []
    with pytest.raises(RuntimeError, match="does not hold"):
        replay(cache, [MirrorLoad(key, 2, (4, 5), 6)], mirror)
    folder = mirror.disk.dir
    mirror.close()
    assert not os.path.exists(folder)


def test_a_corrupted_spill_file_is_an_error_not_a_wrong_prefix(tmp_path: Path) -> None:
    cache, mirror = pools(), TierMirror(str(tmp_path))
    key = snapshot_key(b"anchor", (7, 8))
    replay(cache, [MirrorPack(key, 0, (1, 2), 6), MirrorSpill(key, b"anchor", (7, 8), 6)], mirror)
    assert mirror.disk is not None
    mirror.disk.flush()
    path = mirror.disk.path_of(key)
    raw = bytearray(Path(path).read_bytes())
    raw[-1] ^= 1
    Path(path).write_bytes(bytes(raw))
    with pytest.raises(RuntimeError, match="gone or corrupted"):
        replay(cache, [MirrorLoad(key, 2, (4, 5), 6)], mirror)
    mirror.close()


def test_a_spill_needs_the_entry_and_a_disk_folder(tmp_path: Path) -> None:
    cache = pools()
    with pytest.raises(RuntimeError, match="given no disk_offload_dir"):
        replay(cache, [MirrorPack(b"k", 0, (1, 2), 6), MirrorSpill(b"k", b"anchor", (7, 8), 6)], TierMirror())
    with pytest.raises(RuntimeError, match="does not hold"):
        replay(cache, [MirrorSpill(b"k", b"anchor", (7, 8), 6)], TierMirror(str(tmp_path)))


def test_rank_0s_prefix_cache_logs_spills_and_drops_for_sharded_ranks(tmp_path: Path) -> None:
    """The log a TP rank replays: every eviction to the tiers packs, the host overflow spills, the disk budget drops."""
    cache = CacheTensors.allocate(debug(), num_slots=2, num_pages=16, page_size=4)
    cache.copy_log = []  # as the driver turns it on; mirrors_replicate False: the workers hold shards
    pool = BlockPool(16)
    one = buffer_nbytes(cache, 8)
    prompts = [[n] * 8 for n in range(4)]
    key = snapshot_key(b"salt", ())  # keys and anchors are all this long: the records of these prompts have one size
    record = tier_record.overhead_bytes(TierEntry(key, key, (), 8, torch.zeros(one, dtype=torch.uint8)))
    tiers = TierStack(HostTier(one), DiskTier(str(tmp_path), one + record))  # room for one entry in each
    prefix = PrefixCache(pool, cache, [1], b"salt", tiers)
    for tokens in prompts:  # one snapshot slot: each insert evicts the last prompt's snapshot to the tiers
        pages = pool.allocate(2)
        assert pages is not None and prefix.insert(tokens, pages, slot=0)
        pool.free(pages)  # the request ends; its pages stay cached
    ops = [op for op in cache.copy_log if isinstance(op, MirrorPack | MirrorSpill | MirrorDrop)]
    assert [type(op).__name__ for op in ops] == ["MirrorPack", "MirrorPack", "MirrorSpill", "MirrorPack", "MirrorSpill", "MirrorDrop"]
    keys = [op.key for op in ops]
    assert keys[2] == keys[0] and keys[4] == keys[1] and keys[5] == keys[0], "prompt 0 spills, then the disk budget drops it"
    tiers.close()
