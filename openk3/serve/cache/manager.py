"""CacheManager: the hybrid cache of the running requests -- MLA pages (BlockPool) plus one KDA state slot (StatePool) each --
and the preallocated `CacheTensors` the model reads and writes through them.

Contract: `allocate(req_id, num_tokens)` makes request req_id hold a state slot and enough pages for its first num_tokens tokens,
all or nothing; `free(req_id)` returns both. Only the scheduler calls them (single thread). The page list of a request only
grows while it runs, so the runner can keep its copy in sync from the new page ids alone -- except `trim`, which speculative
decoding uses to release the pages of rejected draft positions (and which is why speculation refuses CUDA graphs for now).
With prefix caching (`prefix` given) the state tensors hold `num_slots` request slots followed by the snapshot slots, pages are
held by requests and by the prefix index (ref counts), and an allocation that finds too few free pages first evicts cached
prefixes (prefix.py states the rule). A new request starts through `match_prefix` -> `fetch` -> `allocate_prefixed`.
Prefix caching also brings a transfer inbox (inbox.py) for prefixes handed over by a prefill engine (handoff.py); its budget is
the device cache's own size: more waiting hand-offs than the device could hold at once means the router runs far ahead.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from openk3.checks import fail
from openk3.config import ModelConfig
from openk3.model.batch import CacheTensors
from openk3.serve.cache.block_pool import BlockPool
from openk3.serve.cache.disk_tier import DiskTier
from openk3.serve.cache.hashing import request_salt
from openk3.serve.cache.inbox import TransferInbox
from openk3.serve.cache.prefix import PrefixCache
from openk3.serve.cache.prefix_types import PrefixCacheConfig, PrefixMatch
from openk3.serve.cache.spec import CacheSpec
from openk3.serve.cache.state_pool import StatePool
from openk3.serve.cache.tier_types import TierKind
from openk3.serve.cache.tiers import HostTier, TierStack
from openk3.serve.cache.transfer import copy_page, copy_slot, unpack


def cache_spec(config: ModelConfig, page_size: int, dtype: torch.dtype, fp8_latent: bool = False) -> CacheSpec:
    return CacheSpec.from_config(config, page_size, cache_dtype_bytes=torch.empty((), dtype=dtype).element_size(), fp8_latent=fp8_latent)


class CacheManager:
    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        page_size: int,
        num_slots: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        prefix: PrefixCacheConfig | None = None,
        scratch: bool = False,
        fp8_latent: bool = False,
        verify_slots: int = 0,
        latent_shards: int = 1,
    ) -> None:
        """`latent_shards` > 1: this process's pools hold its share of every page's latents (decode context parallelism,
        parallel/cp/sharded_mla.py); the block pool still counts the engine's pages of page_size tokens."""
        if page_size < 1:
            fail("CacheManager", "page_size", page_size, ">= 1")
        if num_pages < 1:
            fail("CacheManager", "num_pages", num_pages, ">= 1")
        self.config = config
        self.page_size = page_size
        self.fp8_latent = fp8_latent  # MLA pages in FP8 with scales (ops/mla/fp8_latent.py)
        self.block_pool = BlockPool(num_pages)
        self.state_pool = StatePool(num_slots)
        num_snapshots = prefix.num_snapshot_slots if prefix is not None else 0
        # scratch: one more slot and page than the pools hand out, for the padding rows of captured graphs (serve/graphs.py):
        # they write somewhere, and nothing any request holds may be that place
        extra = 1 if scratch else 0
        if verify_slots < 0:
            fail("CacheManager", "verify_slots", verify_slots, ">= 0")
        first_verify = num_slots + num_snapshots + extra
        self.tensors = CacheTensors.allocate(
            config,
            first_verify + verify_slots,
            num_pages + extra,
            page_size,
            dtype=dtype,
            device=device,
            fp8_latent=fp8_latent,
            latent_shards=latent_shards,
        )
        self.scratch_slot: int | None = num_slots + num_snapshots if scratch else None
        # after every other slot: where a speculative verification keeps its per-position KDA states (serve/spec_states.py);
        # the runner's for the length of one step, held by no request
        self.verify_slots = range(first_verify, first_verify + verify_slots)
        self.scratch_page: int | None = num_pages if scratch else None
        self._pages: dict[str, list[int]] = {}
        self._slots: dict[str, int] = {}
        self.prefix_config = prefix
        self.prefix: PrefixCache | None = None
        self.inbox: TransferInbox | None = None
        if prefix is not None:
            host = HostTier(prefix.host_bytes) if prefix.host_bytes > 0 else None
            disk = DiskTier(prefix.disk_dir, prefix.disk_bytes) if prefix.disk_dir is not None and prefix.disk_bytes > 0 else None
            tiers = TierStack(host, disk) if host is not None or disk is not None else None
            slots = range(num_slots, num_slots + num_snapshots)
            self.prefix = PrefixCache(self.block_pool, self.tensors, slots, prefix.salt, tiers)
            pools = self.tensors.pools()
            self.inbox = TransferInbox(max(1, sum(t.numel() * t.element_size() for t in pools)))

    @staticmethod
    def num_pages_for_memory(
        config: ModelConfig, memory_bytes: int, page_size: int, num_slots: int, dtype: torch.dtype, fp8_latent: bool = False, latent_shards: int = 1
    ) -> int:
        """How many pages fit in memory_bytes after the state slots are paid for (`latent_shards`: a page costs this
        process 1/latent_shards of its bytes, decode context parallelism)."""
        spec = cache_spec(config, page_size, dtype, fp8_latent)
        slots = num_slots * spec.kda.bytes_per_sequence
        per_page = spec.mla.bytes_per_page // latent_shards
        if per_page == 0:  # no MLA layer: pages are bookkeeping only, so allow one sequence of max length per slot
            return num_slots * spec.mla.pages_for(config.max_position_embeddings)
        if memory_bytes - slots < per_page:
            raise ValueError(f"cache memory {memory_bytes} B is too small: {num_slots} state slots need {slots} B and one page {per_page} B more")
        return (memory_bytes - slots) // per_page

    @property
    def num_pages(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_pages(self) -> int:
        return self.block_pool.num_free

    @property
    def num_free_slots(self) -> int:
        return self.state_pool.num_free

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def holds(self, req_id: str) -> bool:
        return req_id in self._slots

    def page_ids(self, req_id: str) -> list[int]:
        return self._pages[req_id]

    def slot(self, req_id: str) -> int:
        return self._slots[req_id]

    def can_allocate(self, req_id: str, num_tokens: int) -> bool:
        need_slot = req_id not in self._slots
        if need_slot and self.state_pool.num_free == 0:
            return False
        return self.pages_for(num_tokens) - len(self._pages.get(req_id, ())) <= self.block_pool.num_free

    def allocate(self, req_id: str, num_tokens: int) -> list[int] | None:
        """Grow req_id's holding to cover num_tokens tokens; returns the newly added page ids, or None (nothing changed)."""
        if self.prefix is not None:
            self.prefix.evict_for_pages(self.pages_for(num_tokens) - len(self._pages.get(req_id, ())))
        if not self.can_allocate(req_id, num_tokens):
            return None
        if req_id not in self._slots:
            slot = self.state_pool.allocate()
            assert slot is not None  # can_allocate checked
            self._slots[req_id] = slot
            self._pages[req_id] = []
        pages = self._pages[req_id]
        new = self.block_pool.allocate(max(0, self.pages_for(num_tokens) - len(pages)))
        assert new is not None  # can_allocate checked
        pages.extend(new)
        return new

    def free(self, req_id: str) -> None:
        """Return req_id's pages (last page first, so the tail of a sequence is reused first) and its slot."""
        pages = self._pages.pop(req_id)
        self.block_pool.free(pages[::-1])
        self.state_pool.free(self._slots.pop(req_id))

    def trim(self, req_id: str, num_tokens: int) -> None:
        """Release req_id's pages past its first num_tokens tokens (the pages of rejected speculative positions)."""
        pages = self._pages[req_id]
        keep = self.pages_for(num_tokens)
        if len(pages) > keep:
            self.block_pool.free(pages[keep:][::-1])
            del pages[keep:]

    @property
    def num_request_holders(self) -> int:
        return len(self._slots)

    def match_prefix(self, tokens: list[int], cache_salt: str | None = None) -> PrefixMatch:
        """The deepest cached boundary of `tokens` (at most len - 1: the last token is computed for its logits), on the
        device or, when deeper, in a lower tier or the transfer inbox; only among prefixes cached under the same
        `cache_salt` (a request's, vLLM's field; None: the unsalted ones)."""
        assert self.prefix is not None
        limit = len(tokens) - 1
        salt = request_salt(self.prefix.salt, cache_salt)
        match, keys = self.prefix.match(tokens, limit, salt)
        tiers, found = self.prefix.tiers, []
        if tiers is not None:
            found.append(tiers.deepest(salt, keys, tokens, self.page_size, limit))
        if self.inbox is not None:
            got = self.inbox.deepest(salt, keys, tokens, self.page_size, limit)
            found.append(None if got is None else (TierKind.INBOX, *got))
        deeper = max((f for f in found if f is not None), key=lambda f: f[2], default=None)
        if deeper is None or deeper[2] <= match.num_tokens:
            return match
        tier, key, p = deeper
        return PrefixMatch(p, tier, key, (), None, None, match.matched_tokens, fallback=match)

    def fetch(self, match: PrefixMatch) -> PrefixMatch:
        """Load a host/disk/inbox hit's buffer; a failed load (gone, or a bad checksum) gives the device match instead."""
        if match.tier in (None, TierKind.DEVICE) or match.buffer is not None:
            return match
        if match.tier == TierKind.INBOX:
            assert self.inbox is not None and match.key is not None and match.fallback is not None
            e = self.inbox.get(match.key)  # left in place until allocate_prefixed succeeds: admission may fail this step
            return match.fallback if e is None else replace(match, buffer=e.buffer)
        assert self.prefix is not None and self.prefix.tiers is not None and match.key is not None and match.fallback is not None
        buf = self.prefix.load_from_tier(match.tier, match.key)
        return match.fallback if buf is None else replace(match, buffer=buf)

    def allocate_prefixed(self, req_id: str, tokens: list[int], match: PrefixMatch, num_tokens: int, cache_salt: str | None = None) -> bool:
        """Admit a new request that starts at match.num_tokens (a fetched match; 0 for a miss) and cover num_tokens tokens,
        all or nothing. Full cached pages are shared, the snapshot and a partial tail page are copied (copy-on-write); a host/disk
        hit is written into fresh pages and snapshotted on the device again."""
        assert self.prefix is not None and req_id not in self._slots
        slot = self.state_pool.allocate()
        if slot is None:
            return False
        prefix, p = self.prefix, match.num_tokens
        shared = list(match.page_ids) if match.tier == TierKind.DEVICE else []
        pinned = shared + ([match.tail_page] if match.tail_page is not None else [])
        self.block_pool.share(pinned)  # the eviction below must not free what this request is about to reuse
        num_new = self.pages_for(num_tokens) - len(shared)
        if not prefix.evict_for_pages(num_new):
            self.block_pool.free(pinned[::-1])
            self.state_pool.free(slot)
            return False
        new = self.block_pool.allocate(num_new)
        assert new is not None
        pages = shared + new
        if match.tier == TierKind.DEVICE:
            assert match.slot is not None
            prefix.counters.device_bytes_copied += copy_slot(self.tensors, match.slot, slot)
            if match.tail_page is not None:
                prefix.counters.device_bytes_copied += copy_page(self.tensors, match.tail_page, new[0])
                self.block_pool.free([match.tail_page])
        elif match.tier is not None:
            assert match.buffer is not None
            # a host or disk tier entry is one that ranks holding shards of these pools mirror (tier_mirror.py), by its key
            unpack(match.buffer, self.tensors, slot, pages, p, key=match.key if match.tier in (TierKind.HOST, TierKind.DISK) else None)
        self._slots[req_id], self._pages[req_id] = slot, pages
        if match.tier not in (None, TierKind.DEVICE):
            prefix.insert(tokens[:p], pages, slot, request_salt(prefix.salt, cache_salt))
        if self.inbox is not None and match.key is not None:
            self.inbox.discard(match.key, hit=match.tier == TierKind.INBOX)  # a hand-off is used once (inbox.py)
        prefix.count_query(len(tokens), p)
        return True

    def snapshot(self, req_id: str, tokens: list[int], cache_salt: str | None = None) -> bool:
        """Cache the state of req_id, which has computed exactly `tokens`, with its pages, under its `cache_salt`."""
        assert self.prefix is not None
        return self.prefix.insert(tokens, self._pages[req_id], self._slots[req_id], request_salt(self.prefix.salt, cache_salt))

    def reserve_snapshot_slot(self) -> int | None:
        """A snapshot slot for the next step to write a state into (PrefixCache.reserve_slot), or None."""
        assert self.prefix is not None
        return self.prefix.reserve_slot()

    def adopt_snapshot(self, req_id: str, tokens: list[int], slot: int, cache_salt: str | None = None) -> bool:
        """Index reserved `slot`, which req_id's step filled with its state after exactly `tokens`, with req_id's pages,
        under its `cache_salt`."""
        assert self.prefix is not None
        return self.prefix.adopt(tokens, self._pages[req_id], slot, request_salt(self.prefix.salt, cache_salt))

    def release_snapshot_slot(self, slot: int) -> None:
        assert self.prefix is not None
        self.prefix.release(slot)

    def close(self) -> None:
        """Stop the disk tier's writer and remove its files."""
        if self.prefix is not None and self.prefix.tiers is not None:
            self.prefix.tiers.close()

    def check_integrity(self) -> None:
        self.block_pool.check_integrity()
        self.state_pool.check_integrity()
        held: dict[int, int] = {}
        if self.prefix is not None:
            self.prefix.check_integrity()
            held = dict(self.prefix.page_refs())
        if self.inbox is not None:
            self.inbox.check_integrity()
        for pages in self._pages.values():
            for p in pages:
                held[p] = held.get(p, 0) + 1
        for p in range(self.num_pages):
            if held.get(p, 0) != self.block_pool.ref_count(p):
                ref = self.block_pool.ref_count(p)
                raise AssertionError(f"CacheManager: page {p} is held {held.get(p, 0)} times (requests + prefix index) but has ref count {ref}")
        slots = list(self._slots.values())
        if len(set(slots)) != len(slots):
            raise AssertionError(f"CacheManager: a state slot is held by two requests: {self._slots}")
        for s in range(self.state_pool.num_slots):
            if (s in slots) != self.state_pool.is_held(s):
                raise AssertionError(f"CacheManager: slot {s} held={self.state_pool.is_held(s)} but owned by a request={s in slots}")
        if set(self._pages) != set(self._slots):
            raise AssertionError("CacheManager: requests with pages and requests with slots differ")
