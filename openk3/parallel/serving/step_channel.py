"""The driver -> worker wire format of expert-parallel serving: one message per model call, broadcast from rank 0.

Legend: T tokens of the step, N sequences, P page-table width, M logits rows, W ranks.

Rank 0 (the driver) alone schedules and samples; the other ranks run the same forward on the same batch, because every MoE
layer is a collective (their experts, their share of the tokens). A message is a fixed int64 header, then for a step one
int64 payload holding the batch's tensors end to end, so a step costs two broadcasts whatever its size:

  header   [kind, a, b, c, d, e, f, g, h]
    STEP   a=T, b=N, c=P (-1: no cache), d=M (-1: every row), e=the step's form (0 prefill, 1 decode, 2 stepwise), and the
           batch's host facts (model/batch.py):
           f=any_fresh (-1: none given), g=first slot of a consecutive range (-1: not consecutive, -2: none given),
           h=the number of state cuts (prefix-cache snapshots inside the step)
    CACHE  a=num_slots, b=num_pages, c=page_size, d=dtype index, e=elements of all pools (a check of the layout),
           f=latent_shards (decode context parallelism: each rank's pages hold page_size / f rows, its share), g=1 for an
           FP8 latent cache (the MLA pages hold packed e4m3 rows: kv_cache_dtype="fp8")
    COPIES a=n; payload [n, 3] (kind, src, dst): the slot and page copies rank 0's prefix cache made since the last step
           (CacheTensors.copy_log), which every worker replays on its own pools before the next STEP
    LOAD   a=slot, b=number of pages, c=tokens, d=buffer bytes; payloads pages[b] (int64), then the buffer (uint8): a host
           or disk tier load into rank 0's pools, sent in its place among the copies when the workers' pools are replicas
           of rank 0's (no TP shard of their own: CacheTensors.mirrors_replicate), which unpack the same buffer
    MIRROR a=op (1 pack, 2 load, 3 drop), b=slot, c=number of pages, d=tokens, e=key bytes; payload the key's bytes (one
           int64 each), then pages[c]: what rank 0's tiers did, for workers whose pools are shards (TP, decode CP), which
           repeat it on their own pools and tier mirror (serve/cache/tier_mirror.py). Op 4 (spill: the entry went from
           the host tier to disk): b=anchor bytes, c=anchor bytes + tail tokens, d=tokens; payload key, anchor, tail
    STOP   no payload; a barrier, then the worker leaves its loop
  payload  input_ids[T] positions[T] cu_seqlens[N+1] context_lens[N] state_slots[N] page_table[N*P] logits_indices[M]
           state_cuts[h, 3] (seq, offset, slot)

Before any message, `report_ready` gathers every rank's start-up result (None or its error), so a rank that failed to
build its model is reported by rank 0 instead of surfacing as a bare gloo error in the first step.

CACHE goes once, before the first step: workers allocate pools of rank 0's shapes, so the same page and slot ids address
the same rows everywhere. The channel uses its own gloo group (CPU tensors, a long timeout): a worker waits in it while
the server is idle, and an NCCL group would time the wait out (and wants device tensors for a few integers).
"""

from __future__ import annotations

import dataclasses
import datetime
from enum import IntEnum
from typing import NamedTuple

import torch
import torch.distributed as dist

from openk3.config import ModelConfig
from openk3.model.batch import CacheTensors, CopyEntry, ForwardBatch, HostFacts, MirrorDrop, MirrorLoad, MirrorPack, MirrorSpill, StateCut, TierLoad
from openk3.parallel.group import ParallelContext

HEADER = 9
# The ForwardBatch fields this wire format carries; a field added to the batch must be added here too (checked at start).
CARRIED_FIELDS = (
    "input_ids", "positions", "cu_seqlens", "context_lens", "state_slots", "page_table", "logits_indices", "is_decode", "capturable", "host_facts",
    "mm_embeds", "mm_rows", "state_cuts", "stepwise",
)  # fmt: skip
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# How long a worker may wait for the next message: an idle server sends nothing, so this bounds idleness, not step time.
IDLE_TIMEOUT = datetime.timedelta(days=30)


class MessageKind(IntEnum):
    STEP = 1
    CACHE = 2
    STOP = 3
    COPIES = 4
    LOAD = 5
    MIRROR = 6


class CopyLog(NamedTuple):
    copies: list[CopyEntry]


class CacheShape(NamedTuple):
    num_slots: int
    num_pages: int
    page_size: int
    dtype: torch.dtype
    elements: int  # of all pools together
    latent_shards: int = 1
    fp8_latent: bool = False  # the MLA pages hold packed e4m3 rows (ops/mla/fp8_latent.py): uint8 pools

    @classmethod
    def of(cls, cache: CacheTensors) -> CacheShape:
        pools = cache.conv_state or cache.mla_latent
        dtype = pools[0].dtype if pools else torch.float32
        fp8 = bool(cache.mla_latent) and cache.mla_latent[0].dtype == torch.uint8
        return cls(cache.num_slots, cache.num_pages, cache.page_size, dtype, pool_elements(cache), cache.latent_shards, fp8)

    def allocate(self, config: ModelConfig, device: torch.device | str) -> CacheTensors:
        """Pools of the announced shapes; a worker whose config lays them out differently from rank 0's is refused."""
        cache = CacheTensors.allocate(
            config, self.num_slots, self.num_pages, self.page_size, self.dtype, device, fp8_latent=self.fp8_latent, latent_shards=self.latent_shards
        )
        if pool_elements(cache) != self.elements:
            raise RuntimeError(f"expert-parallel worker: its cache pools hold {pool_elements(cache)} elements, rank 0's {self.elements}: different models")
        return cache


def pool_elements(cache: CacheTensors) -> int:
    return sum(t.numel() for t in cache.pools())


class StepChannel:
    """Broadcasts from rank 0 of `ctx` to the other ranks over a gloo group of its own; every rank must construct it
    (group creation is collective), in the same order relative to other groups."""

    def __init__(self, ctx: ParallelContext) -> None:
        if ctx.group is None:
            raise ValueError("StepChannel: a world of one has nobody to broadcast to")
        names = tuple(f.name for f in dataclasses.fields(ForwardBatch))
        if names != CARRIED_FIELDS:
            raise RuntimeError(f"StepChannel carries ForwardBatch fields {CARRIED_FIELDS}, the batch now has {names}: extend the wire format")
        self.ctx = ctx
        # members only (local synchronization): a DP group's TP ranks open theirs without the other groups
        self.group = dist.new_group(dist.get_process_group_ranks(ctx.group), timeout=IDLE_TIMEOUT, backend="gloo", use_local_synchronization=True)
        self.src = dist.get_global_rank(ctx.group, 0)

    def _send(self, header: list[int], payload: torch.Tensor | None = None) -> None:
        if self.ctx.rank != 0:
            raise RuntimeError(f"StepChannel: rank {self.ctx.rank} tried to send; only rank 0 drives")
        dist.broadcast(torch.tensor(header + [0] * (HEADER - len(header)), dtype=torch.int64), self.src, group=self.group)
        if payload is not None:
            dist.broadcast(payload, self.src, group=self.group)

    def send_cache(self, cache: CacheTensors) -> None:
        shape = CacheShape.of(cache)
        if shape.dtype not in CACHE_DTYPES:
            raise ValueError(f"StepChannel: cache dtype {shape.dtype} is not one of {CACHE_DTYPES}")
        index = CACHE_DTYPES.index(shape.dtype)
        header = [MessageKind.CACHE, shape.num_slots, shape.num_pages, shape.page_size, index, shape.elements, shape.latent_shards, int(shape.fp8_latent)]
        self._send(header)

    @staticmethod
    def encode_step(batch: ForwardBatch) -> tuple[list[int], torch.Tensor]:
        """The header and payload of a step; raises before anything is sent for a batch the wire format cannot carry."""
        if batch.capturable:
            raise ValueError("StepChannel: a capturable batch is a decode graph's, and graphs capture a single-process step only")
        if batch.mm_embeds is not None or batch.mm_rows is not None:
            raise ValueError("StepChannel: image inputs (mm_embeds, mm_rows) are not carried to the other ranks: a multi-rank engine serves text only")
        parts = [batch.input_ids, batch.positions, batch.cu_seqlens, batch.context_lens]
        width = -1
        if (batch.state_slots is None) != (batch.page_table is None):
            # c = -1 stands for both absent: one sent alone would be silently dropped on the workers
            given, missing = ("state_slots", "page_table") if batch.page_table is None else ("page_table", "state_slots")
            raise ValueError(f"StepChannel: the batch has {given} but {missing} is None; the wire format carries both or neither")
        if batch.state_slots is not None and batch.page_table is not None:
            width = batch.page_table.shape[1]
            parts += [batch.state_slots, batch.page_table.reshape(-1)]
        rows = -1
        if batch.logits_indices is not None:
            rows = batch.logits_indices.numel()
            parts.append(batch.logits_indices)
        if batch.state_cuts:
            parts.append(torch.tensor(batch.state_cuts, dtype=torch.int64))
        payload = torch.cat([p.detach().reshape(-1).to(device="cpu", dtype=torch.int64) for p in parts])
        facts = batch.host_facts
        fresh = -1 if facts is None else int(facts.any_fresh)
        first = -2 if facts is None else -1 if facts.slot_range is None else facts.slot_range[0]
        form = 2 if batch.stepwise else int(batch.is_decode)
        header = [MessageKind.STEP, batch.input_ids.numel(), batch.num_seqs, width, rows, form, fresh, first, len(batch.state_cuts)]
        return header, payload

    def send_encoded(self, header: list[int], payload: torch.Tensor) -> None:
        self._send(header, payload)

    def send_copies(self, copies: list[CopyEntry]) -> None:
        """The copy log in order: each run of slot and page copies as one COPIES message, each tier load as a LOAD."""
        run: list[tuple[int, int, int]] = []
        for entry in [*copies, None]:
            if isinstance(entry, tuple):
                run.append(entry)
                continue
            if run:
                self._send([MessageKind.COPIES, len(run)], torch.tensor(run, dtype=torch.int64).reshape(-1))
                run = []
            if isinstance(entry, TierLoad):
                pages = torch.tensor(entry.page_ids, dtype=torch.int64)
                self._send([MessageKind.LOAD, entry.slot, pages.numel(), entry.num_tokens, entry.buffer.numel()], pages)
                dist.broadcast(entry.buffer.contiguous(), self.src, group=self.group)
            elif isinstance(entry, MirrorDrop):
                self._send([MessageKind.MIRROR, 3, -1, 0, 0, len(entry.key)], torch.tensor(list(entry.key), dtype=torch.int64))
            elif isinstance(entry, MirrorSpill):
                words = torch.tensor([*entry.key, *entry.anchor, *entry.tail], dtype=torch.int64)
                self._send([MessageKind.MIRROR, 4, len(entry.anchor), len(entry.anchor) + len(entry.tail), entry.num_tokens, len(entry.key)], words)
            elif isinstance(entry, MirrorPack | MirrorLoad):
                op = 1 if isinstance(entry, MirrorPack) else 2
                mirrored = torch.tensor([*entry.key, *entry.page_ids], dtype=torch.int64)
                self._send([MessageKind.MIRROR, op, entry.slot, len(entry.page_ids), entry.num_tokens, len(entry.key)], mirrored)

    def send_step(self, batch: ForwardBatch) -> None:
        self._send(*self.encode_step(batch))

    def report_ready(self, error: str | None) -> list[str | None]:
        """The start-up handshake, collective over every rank: each reports None (model built) or its error; all get all.

        Without it a worker that failed while building would just exit, and rank 0 would learn of it only as a bare gloo
        error in its first step."""
        reports: list[str | None] = [None] * self.ctx.world_size
        dist.all_gather_object(reports, error, group=self.group)
        return reports

    def send_stop(self) -> None:
        """STOP, then a barrier: no rank tears the group down while another is still reading from it (gloo aborts then)."""
        self._send([MessageKind.STOP])
        dist.barrier(group=self.group)

    def receive(self, device: torch.device | str) -> ForwardBatch | CacheShape | CopyLog | None:
        """The next message on a worker: a step's batch (on `device`), the cache shape, copies (or a tier load) to replay, or
        None for STOP."""
        header = torch.zeros(HEADER, dtype=torch.int64)
        dist.broadcast(header, self.src, group=self.group)
        kind, a, b, c, d, e, f, g, h = (int(x) for x in header[:9])
        if kind == MessageKind.STOP:
            dist.barrier(group=self.group)
            return None
        if kind == MessageKind.CACHE:
            if not 0 <= d < len(CACHE_DTYPES):
                raise RuntimeError(f"StepChannel: cache dtype index {d} outside 0..{len(CACHE_DTYPES) - 1}")
            return CacheShape(a, b, c, CACHE_DTYPES[d], e, f, bool(g))
        if kind == MessageKind.COPIES:
            flat = torch.empty(3 * a, dtype=torch.int64)
            dist.broadcast(flat, self.src, group=self.group)
            return CopyLog([(int(k), int(x), int(y)) for k, x, y in flat.reshape(-1, 3).tolist()])
        if kind == MessageKind.MIRROR:
            words = torch.empty(e + c, dtype=torch.int64)
            dist.broadcast(words, self.src, group=self.group)
            values = words.tolist()
            key, mirrored_pages = bytes(values[:e]), tuple(values[e:])
            if a == 3:
                return CopyLog([MirrorDrop(key)])
            if a == 4:  # the words after the key: the anchor's b bytes, then the tail's tokens
                return CopyLog([MirrorSpill(key, bytes(values[e : e + b]), tuple(values[e + b :]), d)])
            if a not in (1, 2):
                raise RuntimeError(f"StepChannel: mirror op {a} (driver and worker run different openk3 versions?)")
            return CopyLog([(MirrorPack if a == 1 else MirrorLoad)(key, b, mirrored_pages, d)])
        if kind == MessageKind.LOAD:
            pages = torch.empty(b, dtype=torch.int64)
            dist.broadcast(pages, self.src, group=self.group)
            buffer = torch.empty(d, dtype=torch.uint8)
            dist.broadcast(buffer, self.src, group=self.group)
            return CopyLog([TierLoad(buffer, a, tuple(int(x) for x in pages.tolist()), c)])
        if kind != MessageKind.STEP:
            raise RuntimeError(f"StepChannel: unknown message kind {kind} (driver and worker run different openk3 versions?)")
        tokens, seqs, width, rows = a, b, c, d
        sizes = [tokens, tokens, seqs + 1, seqs] + ([seqs, seqs * width] if width >= 0 else []) + ([rows] if rows >= 0 else []) + [3 * h]
        payload = torch.empty(sum(sizes), dtype=torch.int64)
        dist.broadcast(payload, self.src, group=self.group)
        parts = [p.to(device) for p in payload.split(sizes)]
        ids, positions, cu, context = parts[:4]
        slots, table = (parts[4], parts[5].reshape(seqs, width)) if width >= 0 else (None, None)
        logits = parts[-2] if rows >= 0 else None
        cuts = tuple(StateCut(*(int(x) for x in row)) for row in parts[-1].reshape(h, 3).tolist())
        if e not in (0, 1, 2):
            raise RuntimeError(f"StepChannel: step form e={e} in a step header (driver and worker run different openk3 versions?)")
        if f not in (-1, 0, 1) or g < -2 or (f == -1) != (g == -2):
            raise RuntimeError(f"StepChannel: host facts f={f}, g={g} in a step header (driver and worker run different openk3 versions?)")
        facts = None if f == -1 else HostFacts(bool(f), None if g == -1 else (g, g + seqs))
        return ForwardBatch(ids, positions, cu, context, slots, table, logits, e == 1, host_facts=facts, state_cuts=cuts, stepwise=e == 2)
