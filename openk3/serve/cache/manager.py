"""CacheManager: the hybrid cache of the running requests -- MLA pages (BlockPool) plus one KDA state slot (StatePool) each --
and the preallocated `CacheTensors` the model reads and writes through them.

Contract: `allocate(req_id, num_tokens)` makes request req_id hold a state slot and enough pages for its first num_tokens tokens,
all or nothing; `free(req_id)` returns both. Only the scheduler calls them (single thread). The page list of a request only
grows while it runs, so the runner can keep its copy in sync from the new page ids alone.
"""

from __future__ import annotations

import torch

from openk3.config import ModelConfig
from openk3.model.batch import CacheTensors
from openk3.serve.cache.block_pool import BlockPool
from openk3.serve.cache.spec import CacheSpec
from openk3.serve.cache.state_pool import StatePool


def cache_spec(config: ModelConfig, page_size: int, dtype: torch.dtype) -> CacheSpec:
    return CacheSpec.from_config(config, page_size, cache_dtype_bytes=torch.empty((), dtype=dtype).element_size())


class CacheManager:
    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        page_size: int,
        num_slots: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if page_size < 1:
            raise ValueError(f"CacheManager.page_size={page_size} is invalid: expected >= 1")
        if num_pages < 1:
            raise ValueError(f"CacheManager.num_pages={num_pages} is invalid: expected >= 1")
        self.config = config
        self.page_size = page_size
        self.block_pool = BlockPool(num_pages)
        self.state_pool = StatePool(num_slots)
        self.tensors = CacheTensors.allocate(config, num_slots, num_pages, page_size, dtype=dtype, device=device)
        self._pages: dict[str, list[int]] = {}
        self._slots: dict[str, int] = {}

    @staticmethod
    def num_pages_for_memory(config: ModelConfig, memory_bytes: int, page_size: int, num_slots: int, dtype: torch.dtype) -> int:
        """How many pages fit in memory_bytes after the state slots are paid for."""
        spec = cache_spec(config, page_size, dtype)
        slots = num_slots * spec.kda.bytes_per_sequence
        per_page = spec.mla.bytes_per_page
        if per_page == 0:  # no MLA layer: pages are bookkeeping only, so allow one sequence of max length per slot
            return num_slots * spec.mla.pages_for(config.max_position_embeddings)
        if memory_bytes - slots < per_page:
            raise ValueError(
                f"cache memory {memory_bytes} B is too small: {num_slots} state slots need {slots} B and one page {per_page} B more"
            )
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

    def check_integrity(self) -> None:
        self.block_pool.check_integrity()
        self.state_pool.check_integrity()
        held: dict[int, int] = {}
        for pages in self._pages.values():
            for p in pages:
                held[p] = held.get(p, 0) + 1
        for p in range(self.num_pages):
            if held.get(p, 0) != self.block_pool.ref_count(p):
                ref = self.block_pool.ref_count(p)
                raise AssertionError(f"CacheManager: page {p} is held by {held.get(p, 0)} requests but has ref count {ref}")
        slots = list(self._slots.values())
        if len(set(slots)) != len(slots):
            raise AssertionError(f"CacheManager: a state slot is held by two requests: {self._slots}")
        for s in range(self.state_pool.num_slots):
            if (s in slots) != self.state_pool.is_held(s):
                raise AssertionError(f"CacheManager: slot {s} held={self.state_pool.is_held(s)} but owned by a request={s in slots}")
        if set(self._pages) != set(self._slots):
            raise AssertionError("CacheManager: requests with pages and requests with slots differ")
