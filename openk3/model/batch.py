"""The only types that cross the serve <-> model seam: one step's packed batch and the cache tensors it reads and writes.

Legend: T tokens in the step (all sequences laid end to end), N sequences, P pages per sequence (max), S state slots,
L_kda / L_mla layers of each kind, E image-embedding rows in the step, H heads, K = V = KDA head dim, C = 3 * H * K conv channels, W conv kernel,
NP pages in the pool, PS tokens per page, R = kv_lora_rank + qk_rope_head_dim (the MLA latent width).

Contract: the model reads the cache state of sequence i from `state_slots[i]` and pages `page_table[i]`, writes the
state after the step back into the same slot and the new tokens' latents into the pages covering positions
`[context_lens[i], context_lens[i] + new_tokens_i)`, and for each of `state_cuts` the KDA state (and conv window) a sequence
has inside the step into that cut's slot (prefix-cache snapshots). It never allocates or frees slots and pages: the cache manager does,
and it must have zeroed nothing in particular -- a sequence with `context_lens[i] == 0` starts from a zero state whatever the
slot holds.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from openk3.config import LayerKind, ModelConfig
from openk3.config.cache_format import fp8_latent_width
from openk3.model.stepwise import StepwisePlan


@dataclass(frozen=True)
class HostFacts:
    """What the runner knows on the host about a step's sequences, so that the model need not read it back from the tensors."""

    any_fresh: bool  # some sequence has no context yet
    slot_range: tuple[int, int] | None  # (first, end) when the state slots are consecutive ascending ids

    @staticmethod
    def of(context_lens: Sequence[int], state_slots: Sequence[int]) -> HostFacts:
        first = state_slots[0] if state_slots else 0
        consecutive = bool(state_slots) and all(s == first + i for i, s in enumerate(state_slots))
        return HostFacts(any(c == 0 for c in context_lens), (first, first + len(state_slots)) if consecutive else None)


class StateCut(NamedTuple):
    """A state to copy out of a step: sequence `seq`'s KDA state after the first `offset` of its new tokens (0 < offset <
    its tokens in the step), written to state slot `slot`."""

    seq: int
    offset: int
    slot: int


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute positions
    cu_seqlens: torch.Tensor  # [N + 1] int64, sequence i owns tokens cu_seqlens[i]:cu_seqlens[i+1]
    context_lens: torch.Tensor  # [N] int64, tokens already in the cache before this step
    state_slots: torch.Tensor | None = None  # [N] int64, KDA state slot per sequence (None: no cache)
    page_table: torch.Tensor | None = None  # [N, P] int64 MLA page ids (None: no cache)
    logits_indices: torch.Tensor | None = None  # [M] token rows whose logits are wanted (None: all)
    is_decode: bool = False  # every sequence contributes exactly one token: the runner picks decode ops
    # The batch of a captured graph (serve/graphs.py): its tensors are static buffers refilled before every replay, so the
    # model may decide nothing from their values on the host: the fresh mask is always applied, slots always gathered.
    capturable: bool = False
    # given by the runner (and the step channel), which built the tensors from host lists; None: read from the tensors
    host_facts: HostFacts | None = None
    # image inputs: the projected patch embeddings [E, D] that replace the token embeddings of packed rows `mm_rows` [E]
    # (media placeholder tokens); both None, or both set with E rows each
    mm_embeds: torch.Tensor | None = None
    mm_rows: torch.Tensor | None = None
    # KDA states wanted inside the step (prefix-cache snapshots, serve/scheduler.py): each KDA layer also writes the state
    # (and conv window) a sequence has after `offset` of its new tokens into `slot`; none in a decode or capturable batch
    state_cuts: tuple[StateCut, ...] = ()
    # every sequence's new tokens run one position after another through the decode forms (KDA's recurrent step, MLA's
    # absorbed attention over the pages): a speculative verification's few tokens per sequence (model/stepwise.py); its
    # state_cuts then take the KDA state after any of a sequence's positions, the per-position states of the verification
    stepwise: bool = False

    def __post_init__(self) -> None:
        if self.state_cuts and (self.is_decode or self.capturable or self.state_slots is None):
            raise ValueError("ForwardBatch.state_cuts: only a prefill batch with a cache can take states inside its sequences")
        if self.stepwise and (self.is_decode or self.capturable or self.state_slots is None):
            raise ValueError("ForwardBatch.stepwise: only a batch with a cache and a sequence of several tokens runs position by position")

    # fresh_seqs, slot_range and latent_rows below are computed once per batch on first use (every layer asks): a batch is
    # built for one step and its tensors are never modified afterwards (a graph makes a new capturable batch over its
    # buffers per run).

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def uses_cache(self) -> bool:
        return self.state_slots is not None

    @functools.cached_property
    def fresh_seqs(self) -> torch.Tensor | None:
        """[N] bool, the sequences with no context (they start from a zero KDA state whatever their slot holds), or None when
        there are none: the usual step then skips the masking. Without host facts one host check per step, shared by every
        KDA layer; none in a capturable batch, which always masks."""
        fresh = self.context_lens == 0
        if self.capturable:
            return fresh
        if self.host_facts is not None:
            return fresh if self.host_facts.any_fresh else None
        return fresh if bool(fresh.any()) else None

    @functools.cached_property
    def slot_range(self) -> tuple[int, int] | None:
        """(first, end) when `state_slots` are consecutive ascending ids, else None: the KDA layers then update their state
        pools in place through a slice instead of gathering and scattering the slots (the state is most of a decode step's
        memory traffic). The state pool hands out slots in order, so a batch admitted together usually qualifies."""
        if self.capturable or self.state_slots is None or self.state_slots.numel() == 0:
            return None
        if self.host_facts is not None:
            return self.host_facts.slot_range
        first, n = int(self.state_slots[0]), self.state_slots.numel()
        expected = torch.arange(first, first + n, device=self.state_slots.device, dtype=self.state_slots.dtype)
        return (first, first + n) if torch.equal(self.state_slots, expected) else None

    @functools.cached_property
    def stepwise_plan(self) -> StepwisePlan:
        """The rows, slots and state cuts of each position of a stepwise batch, built once per batch (every layer asks)."""
        if self.state_slots is None:
            raise ValueError("ForwardBatch.stepwise: the batch has no cache (state_slots is None)")
        return StepwisePlan.of(self.host_cu_seqlens, self.state_slots, self.fresh_seqs, self.state_cuts)

    def latent_rows(self, page_size: int, page_table: torch.Tensor | None = None) -> torch.Tensor:
        """[T] int64: where each new token's latent goes in an MLA pool seen as [NP * PS, R] rows -- token position p of
        sequence i in page page_table[i, p // PS] at offset p % PS. Built once per batch and page size from the batch's own
        page table (every MLA layer writes there); `page_table`: another table, computed for this call only."""
        own = page_table is None or page_table is self.page_table
        rows = self._latent_rows.get(page_size) if own else None
        if rows is None:
            table = self.page_table if page_table is None else page_table
            if table is None:
                raise ValueError("ForwardBatch.latent_rows: the batch has no page table (no cache)")
            seqs = torch.arange(self.num_seqs, device=self.positions.device)
            # a decode step has one token per sequence, in sequence order
            seq_of_token = seqs if self.is_decode else torch.repeat_interleave(seqs, self.seq_lens, output_size=self.positions.shape[0])
            rows = table[seq_of_token, self.positions // page_size] * page_size + self.positions % page_size
            if own:
                self._latent_rows[page_size] = rows
        return rows

    @functools.cached_property
    def _latent_rows(self) -> dict[int, torch.Tensor]:
        return {}

    @functools.cached_property
    def host_cu_seqlens(self) -> list[int]:
        """cu_seqlens read to the host once per batch (the KDA layers split sequences at `state_cuts` by it)."""
        return [int(x) for x in self.cu_seqlens.tolist()]

    @staticmethod
    def from_tokens(input_ids: torch.Tensor) -> ForwardBatch:
        """A cache-free batch of equal-length sequences [B, L] (training and reference forwards)."""
        b, seq_len = input_ids.shape
        device = input_ids.device
        return ForwardBatch(
            input_ids=input_ids.reshape(-1),
            positions=torch.arange(seq_len, device=device).repeat(b),
            cu_seqlens=torch.arange(0, (b + 1) * seq_len, seq_len, device=device, dtype=torch.int64),
            context_lens=torch.zeros(b, dtype=torch.int64, device=device),
        )

    @staticmethod
    def for_step(
        token_lists: list[list[int]], context_lens: list[int], state_slots: list[int], page_table: torch.Tensor, only_last_logits: bool = True
    ) -> ForwardBatch:
        """Pack the new tokens of several cached sequences into one step (what the runner builds each iteration)."""
        device = page_table.device
        lens = [len(t) for t in token_lists]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        positions = [c + j for c, n in zip(context_lens, lens, strict=True) for j in range(n)]
        return ForwardBatch(
            input_ids=torch.tensor([t for toks in token_lists for t in toks], dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            cu_seqlens=torch.tensor(cu, dtype=torch.int64, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int64, device=device),
            state_slots=torch.tensor(state_slots, dtype=torch.int64, device=device),
            page_table=page_table,
            logits_indices=torch.tensor(cu[1:], dtype=torch.int64, device=device) - 1 if only_last_logits else None,
            is_decode=all(n == 1 for n in lens),
            host_facts=HostFacts.of(context_lens, state_slots),
        )


def _latent_row(latent_dim: int, dtype: torch.dtype, fp8: bool) -> tuple[int, torch.dtype]:
    """(width, dtype) of one token's row in an MLA page: R values of the cache dtype, or the FP8 packed bytes."""
    return (fp8_latent_width(latent_dim), torch.uint8) if fp8 else (latent_dim, dtype)


@dataclass(frozen=True)
class TierLoad:
    """A prefix written into a slot and pages from a tier buffer (transfer.unpack), as the copy log carries it."""

    buffer: torch.Tensor  # transfer.pack layout, uint8 on the host
    slot: int
    page_ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class MirrorPack:
    """Rank 0 offloaded a prefix (slot, pages) into its host tier under `key`: a rank holding shards of its own packs its
    own pools the same way and keeps the buffer under that key (tensor parallelism: a TP rank's KDA heads are its own)."""

    key: bytes
    slot: int
    page_ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class MirrorLoad:
    """Rank 0 loaded its tier entry `key` into a slot and pages: a sharded rank unpacks its own buffer of that key."""

    key: bytes
    slot: int
    page_ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class MirrorSpill:
    """Rank 0's host tier overflowed its entry `key` to its disk tier: a sharded rank writes its own buffer of that key to a
    disk tier of its own (tier_mirror.py), under the same anchor and tail (the record's header carries them)."""

    key: bytes
    anchor: bytes
    tail: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class MirrorDrop:
    """Rank 0's tiers let the entry `key` go: a sharded rank drops its buffer (or its file) too (after the copies before the next
    step, which may still load it: rank 0 fetched the buffer before the eviction that dropped it)."""

    key: bytes


# what a rank holding shards repeats of rank 0's tiers (serve/cache/tier_mirror.py)
MirrorOp = MirrorPack | MirrorLoad | MirrorSpill | MirrorDrop
# (kind, src, dst) of a slot or page copy, a tier load with its buffer (replica ranks), or a mirror op (sharded ranks)
CopyEntry = tuple[int, int, int] | TierLoad | MirrorOp


@dataclass
class CacheTensors:
    """Preallocated pools. The model mutates their contents in place; their shapes never change."""

    kda_state: list[torch.Tensor]  # per KDA layer [S, H, K, V] fp32
    conv_state: list[torch.Tensor]  # per KDA layer [S, C, W - 1], q | k | v channels
    mla_latent: list[torch.Tensor]  # per MLA layer [NP, PS, R] ([NP, PS / latent_shards, R] with decode context parallelism)
    page_size: int
    # When a list: every copy between slots or pages made outside a forward (serve/cache/transfer.py) is recorded here as
    # (kind, src, dst), so that a multi-rank engine can replay it on the other ranks' pools before the next step; and every
    # host/disk tier load: as a TierLoad with its buffer when those pools are replicas of these (`mirrors_replicate`), else
    # (TP shards) as mirror ops: each offload, load and drop of the host tier, which the other ranks repeat on their own.
    copy_log: list[CopyEntry] | None = None
    mirrors_replicate: bool = False  # the ranks that replay copy_log hold these very contents (no TP shard of their own)
    # > 1: decode context parallelism (parallel/cp/sharded_mla.py): this rank's pages hold every latent_shards-th token of
    # each page (its share), page_size / latent_shards rows per page; the page table and page ids are the engine's
    latent_shards: int = 1

    @staticmethod
    def allocate(
        config: ModelConfig,
        num_slots: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        fp8_latent: bool = False,
        latent_shards: int = 1,
    ) -> CacheTensors:
        """`fp8_latent`: the MLA pages hold each token's latent as packed e4m3 values and scales (ops/mla/fp8_latent.py),
        uint8 rows; the conv windows keep `dtype` and the KDA states fp32 either way. `latent_shards`: pages of
        page_size / latent_shards rows, this rank's share (decode context parallelism)."""
        if latent_shards < 1 or page_size % latent_shards:
            raise ValueError(
                f"CacheTensors: page_size={page_size} must be a multiple of latent_shards={latent_shards} (>= 1): a rank holds page_size / shards rows of each"
            )
        kda = config.kda
        n_kda = sum(1 for k in config.layer_kinds if k == LayerKind.KDA)
        n_mla = config.num_hidden_layers - n_kda
        width, row_dtype = _latent_row(config.mla.latent_dim, dtype, fp8_latent)
        return CacheTensors(
            kda_state=[torch.zeros(num_slots, kda.num_heads, kda.head_dim, kda.head_dim, dtype=torch.float32, device=device) for _ in range(n_kda)],
            conv_state=[torch.zeros(num_slots, 3 * kda.proj_dim, kda.conv_kernel - 1, dtype=dtype, device=device) for _ in range(n_kda)],
            mla_latent=[torch.zeros(num_pages, page_size // latent_shards, width, dtype=row_dtype, device=device) for _ in range(n_mla)],
            page_size=page_size,
            latent_shards=latent_shards,
        )

    def pools(self) -> list[torch.Tensor]:
        """Every pool: the KDA states, the conv windows, then the MLA latents."""
        return [*self.kda_state, *self.conv_state, *self.mla_latent]

    @property
    def num_slots(self) -> int:
        return self.kda_state[0].shape[0] if self.kda_state else 0

    @property
    def num_pages(self) -> int:
        return self.mla_latent[0].shape[0] if self.mla_latent else 0
