"""PrefixCache: the device index of cached prefixes -- MLA pages in a tree of chained page keys, KDA state snapshots at boundaries.

A node is one full page (its key chains the salt and every token before its end); a snapshot is the KDA state (+ conv windows)
at a boundary p, hung on the node of the last full page before p, with the tail tokens after it and, when the tail is not empty,
a reference to the page holding those tail tokens. The index holds one block-pool reference per node page and tail page.

A request with a `cache_salt` keys its pages from its own salt (hashing.request_salt), so its prefixes hang under their own root:
one tree per salt in use, the model's own always there, a salted one dropped when its last snapshot goes. Nothing is shared across
roots, neither pages nor a snapshot shorter than a page.

Hit rule: a request may start at the deepest boundary p <= len(tokens) - 1 where a snapshot exists; pages matched deeper without
a state are a miss there (restoring pages without their state produces wrong text). Reuse is copy-on-write: full pages are
shared (ref count + 1), the snapshot is copied into the request's own slot, and a tail page is copied into a fresh page, because
the request will write its next positions into that page.

Eviction (LRU, `check_integrity` enforces the invariants):
- page pressure evicts the least recently used *leaf* snapshot (its node has no child); then every node left with no snapshot at or
  below it is freed, up to the first ancestor that still leads to a snapshot;
- snapshot-slot pressure evicts the least recently used snapshot, leaf or not. A state evicted while deeper snapshots still use its
  pages leaves those pages in place: they serve only longer hits that end at a deeper snapshot, never a hit at the evicted boundary.
- an evicted snapshot goes, with its pages, to the host/disk tiers when there are any (`TierStack.offload`).
States taken inside a prefill step (ForwardBatch.state_cuts) are written by the model straight into a snapshot slot: the
scheduler reserves it (`reserve_slot`, which evicts like any snapshot) before the step and `adopt`s it after, or `release`s it
when the request ended meanwhile; a reserved slot is neither free nor a snapshot.
Not thread-safe: the scheduler's thread owns it (the tiers' disk writer is separate).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from openk3.model.batch import CacheTensors, MirrorDrop, MirrorPack, MirrorSpill
from openk3.serve.cache.block_pool import BlockPool
from openk3.serve.cache.hashing import chain_keys, page_key, snapshot_key
from openk3.serve.cache.prefix_types import PrefixCacheConfig, PrefixCounters, PrefixMatch
from openk3.serve.cache.tier_types import TierEntry, TierKind
from openk3.serve.cache.tiers import TierStack
from openk3.serve.cache.transfer import copy_slot, pack

# the value types moved to prefix_types.py; they stay importable from here for the callers that import them from this module
__all__ = ["PrefixCache", "PrefixCacheConfig", "PrefixCounters", "PrefixMatch"]


@dataclass(eq=False)
class _Node:
    key: bytes
    parent: _Node | None
    page: int | None  # None only at the root
    tokens: tuple[int, ...]
    depth: int  # full pages from the root to here
    children: dict[bytes, _Node] = field(default_factory=dict)
    snapshots: dict[tuple[int, ...], _Snapshot] = field(default_factory=dict)


@dataclass(eq=False)
class _Snapshot:
    key: bytes
    node: _Node
    tail: tuple[int, ...]
    slot: int
    tail_page: int | None
    num_tokens: int


class PrefixCache:
    def __init__(
        self,
        block_pool: BlockPool,
        tensors: CacheTensors,
        snapshot_slots: Sequence[int],
        salt: bytes,
        tiers: TierStack | None = None,
    ) -> None:
        self.pool = block_pool
        self.tensors = tensors
        self.page_size = tensors.page_size
        self.salt = salt
        self.tiers = tiers
        self.all_slots = tuple(snapshot_slots)
        self._free_slots = list(self.all_slots)
        self._reserved: list[int] = []  # slots a step is writing states into, not yet adopted (reserve_slot)
        self.root = _Node(salt, None, None, (), 0)
        self._salted: dict[bytes, _Node] = {}  # request salt -> the root of its prefixes (requests with a cache_salt)
        self._lru: OrderedDict[bytes, _Snapshot] = OrderedDict()
        self._clock = itertools.count()
        self.counters = PrefixCounters()

    @property
    def num_snapshots(self) -> int:
        return len(self._lru)

    def snapshot_boundaries(self) -> list[int]:
        """Boundaries of the cached snapshots, least recently used first (tests read the eviction order from it)."""
        return [s.num_tokens for s in self._lru.values()]

    # lookup ---------------------------------------------------------------------------------------------------------------

    def _root(self, salt: bytes | None, create: bool = False) -> _Node | None:
        """The root the keys under `salt` chain from (None: the model's own salt); None for a salt with nothing cached."""
        if salt is None or salt == self.salt:
            return self.root
        root = self._salted.get(salt)
        if root is None and create:
            root = self._salted[salt] = _Node(salt, None, None, (), 0)
        return root

    def match(self, tokens: Sequence[int], limit: int, salt: bytes | None = None) -> tuple[PrefixMatch, list[bytes]]:
        """Deepest usable boundary <= limit on the device, and the page keys of `tokens` (for the tier lookup), both under
        `salt` (a request's, hashing.request_salt; None: the model's)."""
        ps = self.page_size
        keys = chain_keys(self.salt if salt is None else salt, tokens[: (limit // ps) * ps], ps)
        root = self._root(salt)
        if root is None:
            return PrefixMatch.miss(), keys
        node, j, best = root, 0, None
        while True:
            for tail, snap in node.snapshots.items():
                start = j * ps
                if snap.num_tokens <= limit and (best is None or snap.num_tokens > best.num_tokens):
                    if tuple(tokens[start : start + len(tail)]) == tail:
                        best = snap
            child = node.children.get(keys[j]) if j < len(keys) else None
            if child is None:
                break
            node, j = child, j + 1
        matched = j * ps + self._common_run(node, tokens[j * ps : (j + 1) * ps])
        if best is None:
            return PrefixMatch.miss(matched), keys
        pages = self._path_pages(best.node)
        self._lru.move_to_end(best.key)
        return PrefixMatch(best.num_tokens, TierKind.DEVICE, best.key, tuple(pages), best.tail_page, best.slot, matched), keys

    @staticmethod
    def _common_run(node: _Node, rest: Sequence[int]) -> int:
        """Longest run of `rest` that the index holds after `node` (child pages or snapshot tails)."""
        best = 0
        for run in [c.tokens for c in node.children.values()] + list(node.snapshots):
            n = 0
            while n < min(len(run), len(rest)) and run[n] == rest[n]:
                n += 1
            best = max(best, n)
        return best

    @staticmethod
    def _path_pages(node: _Node) -> list[int]:
        pages = []
        while node.parent is not None:
            assert node.page is not None
            pages.append(node.page)
            node = node.parent
        return pages[::-1]

    def entry(self, tokens: Sequence[int], salt: bytes | None = None) -> TierEntry | None:
        """The snapshot exactly at boundary len(tokens), packed as a tier entry (a copy: the index is unchanged), or None."""
        k = len(tokens) // self.page_size
        node = self._walk(chain_keys(self.salt if salt is None else salt, tokens[: k * self.page_size], self.page_size), salt)
        snap = None if node is None else node.snapshots.get(tuple(tokens[k * self.page_size :]))
        return None if snap is None else self._pack(snap)

    def load_from_tier(self, tier: TierKind, key: bytes) -> torch.Tensor | None:
        """A host or disk entry's buffer; None when it is gone, or when its file failed its checksum: the disk tier deleted
        it then, and the ranks mirroring the tiers drop theirs too."""
        assert self.tiers is not None
        held = self.tiers.contains(key)
        buf = self.tiers.load(tier, key)
        log = self.tensors.copy_log if not self.tensors.mirrors_replicate else None
        if buf is None and held and log is not None and not self.tiers.contains(key):
            log.append(MirrorDrop(key))
        return buf

    def _entry_pages(self, snap: _Snapshot) -> list[int]:
        return self._path_pages(snap.node) + ([snap.tail_page] if snap.tail_page is not None else [])

    def _pack(self, snap: _Snapshot) -> TierEntry:
        return TierEntry(snap.key, snap.node.key, snap.tail, snap.num_tokens, pack(self.tensors, snap.slot, self._entry_pages(snap), snap.num_tokens))

    def count_query(self, num_tokens: int, hit_tokens: int) -> None:
        c = self.counters
        c.queries += 1
        c.query_tokens += num_tokens
        c.hits += hit_tokens > 0
        c.hit_tokens += hit_tokens

    # insertion ------------------------------------------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int], page_ids: Sequence[int], slot: int, salt: bytes | None = None) -> bool:
        """Snapshot the state in `slot` (after exactly `tokens`, keyed under `salt`) with the pages holding them; False when
        already cached or when there is no snapshot slot to take."""
        if not tokens or self._touch(tokens, salt):
            return False
        snap_slot = self._take_slot()  # before building the path: making room may prune nodes of this very path
        if snap_slot is None:
            return False
        self.counters.device_bytes_copied += copy_slot(self.tensors, slot, snap_slot)
        self._hang(tokens, page_ids, snap_slot, salt)
        return True

    def reserve_slot(self) -> int | None:
        """A snapshot slot for a step to write a state into (ForwardBatch.state_cuts), evicting the least recently used
        snapshot when none is free; None when every slot is reserved already. `adopt` or `release` gives it back."""
        slot = self._take_slot()
        if slot is not None:
            self._reserved.append(slot)
        return slot

    def adopt(self, tokens: Sequence[int], page_ids: Sequence[int], slot: int, salt: bytes | None = None) -> bool:
        """Make reserved `slot`, which now holds the state after exactly `tokens`, a snapshot (keyed under `salt`) with the
        pages holding them; False (and the slot freed) when that boundary is cached already."""
        if not tokens or self._touch(tokens, salt):
            self.release(slot)
            return False
        self._reserved.remove(slot)
        self._hang(tokens, page_ids, slot, salt)
        return True

    def release(self, slot: int) -> None:
        """Give back a reserved slot unused (its request ended before its step's states could be adopted)."""
        self._reserved.remove(slot)
        self._free_slots.append(slot)

    def _touch(self, tokens: Sequence[int], salt: bytes | None) -> bool:
        """True (and the snapshot marked most recently used) when boundary len(tokens) is cached under `salt`."""
        k = len(tokens) // self.page_size
        node = self._walk(chain_keys(self.salt if salt is None else salt, tokens[: k * self.page_size], self.page_size), salt)
        snap = None if node is None else node.snapshots.get(tuple(tokens[k * self.page_size :]))
        if snap is not None:
            self._lru.move_to_end(snap.key)
        return snap is not None

    def _hang(self, tokens: Sequence[int], page_ids: Sequence[int], snap_slot: int, salt: bytes | None) -> None:
        """Index the snapshot in `snap_slot` at boundary len(tokens) under `salt`: the path of its full pages, then the
        snapshot."""
        p, ps = len(tokens), self.page_size
        k = p // ps
        keys = chain_keys(self.salt if salt is None else salt, tokens[: k * ps], ps)
        tail = tuple(tokens[k * ps : p])
        node = self._root(salt, create=True)
        assert node is not None
        for j, key in enumerate(keys):
            child = node.children.get(key)
            if child is None:
                child = _Node(key, node, page_ids[j], tuple(tokens[j * ps : (j + 1) * ps]), j + 1)
                self.pool.share([page_ids[j]])
                node.children[key] = child
            node = child
        tail_page = page_ids[k] if tail else None
        if tail_page is not None:
            self.pool.share([tail_page])
        snap = _Snapshot(snapshot_key(node.key, tail), node, tail, snap_slot, tail_page, p)
        node.snapshots[tail] = snap
        self._lru[snap.key] = snap
        self.counters.snapshots_taken += 1

    def _walk(self, keys: Sequence[bytes], salt: bytes | None = None) -> _Node | None:
        node = self._root(salt)
        for key in keys:
            if node is None:
                return None
            child = node.children.get(key)
            if child is None:
                return None
            node = child
        return node

    def _take_slot(self) -> int | None:
        """A free snapshot slot, evicting the least recently used snapshot when none is free; None when there is no slot
        at all or every one is reserved."""
        if not self._free_slots and self._lru:
            self._evict(next(iter(self._lru.values())))
        return self._free_slots.pop(0) if self._free_slots else None

    # eviction -------------------------------------------------------------------------------------------------------------

    def evict_for_pages(self, num_free: int) -> bool:
        """Evict leaf snapshots, least recently used first, until the pool has num_free free pages; False (and nothing
        evicted) when even evicting everything would not free enough."""
        if self.pool.num_free >= num_free:
            return True
        evictable = sum(1 for page, n in self.page_refs().items() if self.pool.ref_count(page) == n)
        if self.pool.num_free + evictable < num_free:
            return False
        while self.pool.num_free < num_free:
            leaf = next((s for s in self._lru.values() if not s.node.children), None)
            if leaf is None:
                return False
            self._evict(leaf)
        return True

    def _evict(self, snap: _Snapshot, offload: bool = True) -> None:
        if offload and self.tiers is not None and not self.tiers.contains(snap.key):
            entry = self._pack(snap)
            log = self.tensors.copy_log if not self.tensors.mirrors_replicate else None
            if log is not None:  # ranks holding shards pack theirs under the same key (transfer.py, driver.py)
                log.append(MirrorPack(entry.key, snap.slot, tuple(self._entry_pages(snap)), snap.num_tokens))
            moves = self.tiers.offload(entry)
            if log is not None:
                log.extend(MirrorSpill(e.key, e.anchor, e.tail, e.num_tokens) for e in moves.spilled)
                log.extend(MirrorDrop(key) for key in moves.gone)
        del snap.node.snapshots[snap.tail]
        del self._lru[snap.key]
        self._free_slots.append(snap.slot)
        if snap.tail_page is not None:
            self.pool.free([snap.tail_page])
        self.counters.snapshots_evicted += 1
        node = snap.node
        while node.parent is not None and not node.children and not node.snapshots:
            del node.parent.children[node.key]
            assert node.page is not None
            self.pool.free([node.page])
            node = node.parent
        if node.parent is None and node is not self.root and not node.children and not node.snapshots:
            del self._salted[node.key]

    def clear(self) -> None:
        while self._lru:
            self._evict(next(iter(self._lru.values())))

    def rekey(self, salt: bytes) -> None:
        """Forget every cached state and key what follows by `salt` (new weights: no state of the old ones may be hit).
        Nothing is offloaded: a lower tier's entries chain the old salt, so they are never hit again and age out. Only with
        no request holding pages (the engine is idle)."""
        while self._lru:
            self._evict(next(iter(self._lru.values())), offload=False)
        if self.root.children or self._salted:
            raise AssertionError("prefix cache: pages left in the index after every snapshot was dropped")
        self.salt = salt
        self.root = _Node(salt, None, None, (), 0)

    # integrity ------------------------------------------------------------------------------------------------------------

    def page_refs(self) -> dict[int, int]:
        """Block-pool references the index holds, per page."""
        refs: dict[int, int] = {}
        stack = [self.root, *self._salted.values()]
        while stack:
            node = stack.pop()
            if node.page is not None:
                refs[node.page] = refs.get(node.page, 0) + 1
            for s in node.snapshots.values():
                if s.tail_page is not None:
                    refs[s.tail_page] = refs.get(s.tail_page, 0) + 1
            stack.extend(node.children.values())
        return refs

    def check_integrity(self) -> None:
        ps = self.page_size
        seen: dict[bytes, _Snapshot] = {}

        def visit(node: _Node) -> bool:
            """Checks the subtree; True when it holds a snapshot."""
            has = bool(node.snapshots)
            for tail, s in node.snapshots.items():
                if s.node is not node or s.tail != tail or len(tail) >= ps or s.num_tokens != node.depth * ps + len(tail):
                    raise AssertionError(f"PrefixCache: snapshot at {s.num_tokens} does not match its node (depth {node.depth}, tail {tail})")
                if (s.tail_page is None) != (not tail) or s.key != snapshot_key(node.key, tail):
                    raise AssertionError(f"PrefixCache: snapshot at {s.num_tokens} has a wrong tail page or key")
                seen[s.key] = s
            for key, child in node.children.items():
                if child.parent is not node or child.key != key or child.depth != node.depth + 1 or len(child.tokens) != ps:
                    raise AssertionError(f"PrefixCache: node at depth {child.depth} is linked wrongly")
                if key != page_key(node.key, child.tokens):
                    raise AssertionError(f"PrefixCache: node at depth {child.depth} has a key that is not the chain of its tokens")
                if not visit(child):
                    raise AssertionError(f"PrefixCache: node at depth {child.depth} leads to no snapshot (it should have been freed)")
                has = True
            return has

        visit(self.root)
        for salt, root in self._salted.items():
            if root.key != salt or root.parent is not None or not visit(root):
                raise AssertionError("PrefixCache: a salted root is linked wrongly or holds no snapshot (it should have been dropped)")
        if seen.keys() != self._lru.keys():
            raise AssertionError("PrefixCache: the LRU list and the tree hold different snapshots")
        used = [s.slot for s in self._lru.values()]
        if sorted(used + self._free_slots + self._reserved) != sorted(self.all_slots):
            raise AssertionError(f"PrefixCache: snapshot slots used {used} + free {self._free_slots} + reserved {self._reserved} != {self.all_slots}")
        for page, n in self.page_refs().items():
            if self.pool.ref_count(page) < n:
                raise AssertionError(f"PrefixCache: page {page} has ref count {self.pool.ref_count(page)} < the index's {n}")
