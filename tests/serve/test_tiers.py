"""Host and disk tiers, and the one-buffer transfer format: exact LRU order, budgets, checksums, page-size independence."""

import os

import pytest
import torch

from openk3.config import debug
from openk3.model.batch import CacheTensors
from openk3.serve.cache import tier_record
from openk3.serve.cache.disk_tier import DiskTier
from openk3.serve.cache.hashing import chain_keys, snapshot_key
from openk3.serve.cache.tier_types import TierEntry, TierKind
from openk3.serve.cache.tiers import HostTier, TierMoves, TierStack
from openk3.serve.cache.transfer import buffer_nbytes, pack, unpack

SALT = b"salt"


def entry(tokens: list[int], nbytes: int = 100, page_size: int = 4, fill: int = 0) -> TierEntry:
    k = len(tokens) // page_size
    keys = chain_keys(SALT, tokens[: k * page_size], page_size)
    anchor = keys[-1] if keys else SALT
    tail = tuple(tokens[k * page_size :])
    return TierEntry(snapshot_key(anchor, tail), anchor, tail, len(tokens), torch.full((nbytes,), fill, dtype=torch.uint8))


def test_pack_unpack_roundtrip_across_page_sizes() -> None:
    g = torch.Generator().manual_seed(0)
    src = CacheTensors.allocate(debug(), num_slots=2, num_pages=6, page_size=4)
    for t in src.pools():
        t.copy_(torch.randn(t.shape, generator=g))
    buf = pack(src, slot=1, page_ids=[5, 2, 3], num_tokens=10)
    assert buf.dtype == torch.uint8 and buf.numel() == buffer_nbytes(src, 10)
    dst = CacheTensors.allocate(debug(), num_slots=3, num_pages=4, page_size=8)
    unpack(buf, dst, slot=2, page_ids=[3, 0], num_tokens=10)
    for a, b in zip(src.kda_state + src.conv_state, dst.kda_state + dst.conv_state, strict=True):
        assert torch.equal(a[1], b[2])
    for a, b in zip(src.mla_latent, dst.mla_latent, strict=True):
        want = torch.cat([a[5], a[2], a[3]])[:10]
        assert torch.equal(torch.cat([b[3], b[0]])[:10], want)
    with pytest.raises(ValueError, match="bytes"):
        unpack(buf[:-1], dst, 2, [3, 0], 10)


@pytest.mark.parametrize("shards", [2, 3])
def test_pack_unpack_of_a_decode_cp_share(shards: int) -> None:
    """Pools holding a rank's interleaved share (latent_shards = W: page_size / W rows per page): a buffer carries the first
    ceil(p / W) rows of the share -- every rank's buffer the same size, rank 0's rows exactly -- and unpacking into other
    pages gives them back."""
    g = torch.Generator().manual_seed(shards)
    page_size, num_tokens = 4 * shards, 4 * shards + 5  # a partly filled second page
    src = CacheTensors.allocate(debug(), num_slots=2, num_pages=6, page_size=page_size, latent_shards=shards)
    for t in src.pools():
        t.copy_(torch.randn(t.shape, generator=g))
    buf = pack(src, slot=1, page_ids=[5, 2], num_tokens=num_tokens)
    per_rank = -(-num_tokens // shards)
    assert buf.numel() == buffer_nbytes(src, num_tokens) == buffer_nbytes(src, 0) + per_rank * sum(p.shape[-1] * p.element_size() for p in src.mla_latent)
    dst = CacheTensors.allocate(debug(), num_slots=3, num_pages=4, page_size=page_size, latent_shards=shards)
    unpack(buf, dst, slot=2, page_ids=[3, 0], num_tokens=num_tokens)
    assert per_rank == len(range(0, num_tokens, shards))  # rank 0 holds the most: every other rank's rows are a prefix of these
    for a, b in zip(src.mla_latent, dst.mla_latent, strict=True):  # a share is a paged sequence over the same pages
        assert torch.equal(torch.cat([b[3], b[0]])[:per_rank], torch.cat([a[5], a[2]])[:per_rank])


def test_host_tier_lru_within_budget() -> None:
    host = HostTier(capacity_bytes=250)
    a, b, c = entry([1] * 5), entry([2] * 5), entry([3] * 5)
    assert host.put(a) == [] and host.put(b) == []
    assert host.get(a.key) is a  # a becomes the most recent
    assert host.put(c) == [b]  # so b is pushed out
    assert list(host.entries) == [a.key, c.key] and host.used_bytes == 200
    assert host.put(entry([4] * 5, nbytes=300)) != [] and host.used_bytes == 200  # never fits: handed straight back
    s = host.stats()
    assert (s.tier, s.entries, s.bytes_in, s.bytes_out, s.hits) == (TierKind.HOST, 2, 300, 100, 1)


def test_deepest_boundary_matches_tail_tokens() -> None:
    host = HostTier(10_000)
    toks = list(range(10, 30))
    for p in (6, 9, 13):
        host.put(entry(toks[:p]))
    keys = chain_keys(SALT, toks[:16], 4)
    stack = TierStack(host, None)
    found = stack.deepest(SALT, keys, toks, 4, limit=19)
    assert found is not None and found[1:] == (entry(toks[:13]).key, 13)
    found = stack.deepest(SALT, keys, toks, 4, limit=12)
    assert found is not None and found[2] == 9
    other = toks[:8] + [0] * 12  # shares the first two pages only: the boundary at 9 has a different tail
    found = stack.deepest(SALT, chain_keys(SALT, other[:16], 4), other, 4, limit=19)
    assert found is not None and found[2] == 6


def test_disk_tier_roundtrip_checksum_and_budget(tmp_path) -> None:
    disk = DiskTier(str(tmp_path), capacity_bytes=2 * (1000 + 400))
    a, b, c = (entry([i] * 6, nbytes=1000, fill=i) for i in (1, 2, 3))
    disk.put(a)
    disk.flush()
    loaded = disk.load(a.key)
    assert loaded is not None and torch.equal(loaded, a.buffer)
    disk.put(b)
    disk.put(c)  # three files do not fit: the least recently used (a, loaded before b and c were written) goes
    disk.flush()
    assert sorted(os.listdir(disk.dir)) == sorted(disk.path_of(e.key).rsplit("/", 1)[1] for e in (b, c))
    assert a.key not in disk and disk.load(a.key) is None
    path = disk.path_of(b.key)
    raw = bytearray(open(path, "rb").read())
    raw[-1] ^= 1
    open(path, "wb").write(bytes(raw))
    assert disk.load(b.key) is None and not os.path.exists(path)
    s = disk.stats()
    assert (s.checksum_failures, s.hits, s.entries) == (1, 1, 1)
    loaded = disk.load(c.key)
    assert loaded is not None and torch.equal(loaded, c.buffer)
    disk.close()
    assert not os.path.exists(disk.dir) and os.path.isdir(tmp_path)


def test_the_disk_budget_is_kept_at_put_and_names_what_it_let_go(tmp_path) -> None:
    a, b, c = (entry([i] * 6, nbytes=1000, fill=i) for i in (1, 2, 3))
    size = tier_record.overhead_bytes(a) + a.nbytes
    assert size == len(tier_record.encode(a))
    disk = DiskTier(str(tmp_path), capacity_bytes=2 * size)
    assert disk.put(a) == [] and disk.put(b) == [] and disk.put(a) == []  # a held already: nothing moves
    assert disk.put(c) == [a.key]  # at once, written or not: the caller's thread learns what left
    assert a.key not in disk and disk.used_bytes == 2 * size
    disk.drop(b.key)
    disk.flush()
    assert os.listdir(disk.dir) == [os.path.basename(disk.path_of(c.key))], "a let-go entry's queued write is skipped"
    assert disk.put(entry([4] * 6, nbytes=3 * size)) == [entry([4] * 6).key]  # can never fit
    disk.close()


def test_a_failed_write_lets_the_entry_go_and_the_writer_lives_on(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from openk3.serve.cache import disk_tier

    disk = DiskTier(str(tmp_path), capacity_bytes=10**6)
    a, b = entry([1] * 6, nbytes=1000, fill=1), entry([2] * 6, nbytes=1000, fill=2)

    def full_disk(path: str, mode: str):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_tier, "open", full_disk, raising=False)
    disk.put(a)
    disk.flush()
    assert a.key not in disk and disk.used_bytes == 0 and disk.load(a.key) is None
    assert disk.stats().write_failures == 1 and os.listdir(disk.dir) == []
    monkeypatch.undo()
    disk.put(b)
    disk.flush()
    loaded = disk.load(b.key)
    assert loaded is not None and torch.equal(loaded, b.buffer)
    disk.close()


def test_a_disk_tier_without_budget_keeps_all_until_dropped(tmp_path) -> None:
    disk = DiskTier(str(tmp_path), capacity_bytes=None)
    entries = [entry([i] * 6, nbytes=1000, fill=i) for i in range(5)]
    assert all(disk.put(e) == [] for e in entries)
    disk.flush()
    assert len(os.listdir(disk.dir)) == 5 and disk.stats().capacity_bytes == 0
    disk.drop(entries[0].key)
    assert len(os.listdir(disk.dir)) == 4 and disk.load(entries[0].key) is None
    loaded = disk.load(entries[4].key)
    assert loaded is not None and torch.equal(loaded, entries[4].buffer)
    disk.close()


def test_stack_sends_host_overflow_to_disk(tmp_path) -> None:
    stack = TierStack(HostTier(150), DiskTier(str(tmp_path), 10**6))
    a, b = entry([1] * 5), entry([2] * 5)
    assert stack.offload(a) == TierMoves()
    assert stack.offload(b) == TierMoves(spilled=[a])  # a no longer fits in the host tier: it moves to disk
    stack.flush()
    assert stack.host is not None and stack.disk is not None
    assert a.key not in stack.host and a.key in stack.disk and b.key in stack.host
    loaded = stack.load(TierKind.DISK, a.key)
    assert loaded is not None and torch.equal(loaded, a.buffer)
    assert stack.load(TierKind.HOST, a.key) is None
    stack.close()


def test_what_leaves_the_stack_is_named(tmp_path) -> None:
    a, b, c = entry([1] * 5), entry([2] * 5), entry([3] * 5)
    host_only = TierStack(HostTier(150), None)
    host_only.offload(a)
    assert host_only.offload(b) == TierMoves(gone=[a.key])
    record = tier_record.overhead_bytes(a) + a.nbytes
    stack = TierStack(HostTier(150), DiskTier(str(tmp_path), record))  # room for one file
    stack.offload(a)
    stack.offload(b)
    assert stack.offload(c) == TierMoves(spilled=[b], gone=[a.key])
    stack.close()
