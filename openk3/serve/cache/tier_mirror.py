"""TierMirror: a rank's copy of rank 0's host and disk tiers, made of its own shards.

Why: rank 0's tiers pack rank 0's pools, and a TP rank's pools differ (its KDA heads, its conv channels; a decode-CP rank
holds its own share of the MLA pages), so rank 0's buffers cannot be unpacked there. Instead rank 0's prefix cache logs
what its tiers do (model/batch.py's mirror ops, sent among the copies before each step: parallel/serving/step_channel.py):
each offload (`MirrorPack`: the slot and pages it packed, still unchanged when the worker replays it, since no forward
runs in between), each move of an entry from the host tier to disk (`MirrorSpill`), each load into a slot and pages
(`MirrorLoad`) and each entry the tiers let go (`MirrorDrop`). The worker packs, spills, unpacks and drops the same
prefixes of its own pools under the same keys, so it holds exactly the keys rank 0's tiers hold, at its shard's bytes
(at most rank 0's): in RAM what rank 0 holds in RAM, in files of its own (a DiskTier in a private folder under the
same disk_offload_dir) what rank 0 holds on disk. That disk tier keeps no budget of its own: rank 0's evictions arrive
as drops, and a budget of its own could let go of an entry rank 0 still holds.

A drop is applied at the next step, not at once: rank 0 fetches an entry's buffer before it makes room for the request
(evictions that may push that very entry out of its tiers) and unpacks it after, so within one step's copies a load may
follow the drop of its key.
"""

from __future__ import annotations

import torch

from openk3.model.batch import CacheTensors, MirrorLoad, MirrorOp, MirrorPack, MirrorSpill
from openk3.serve.cache import transfer
from openk3.serve.cache.disk_tier import DiskTier
from openk3.serve.cache.tier_types import TierEntry


class TierMirror:
    def __init__(self, disk_dir: str | None = None) -> None:
        """`disk_dir`: the engine's disk_offload_dir, under which spilled entries go (a folder of this rank's own, made at
        the first spill); None when rank 0 has no disk tier (a spill is then an error)."""
        self.entries: dict[bytes, torch.Tensor] = {}
        self.disk: DiskTier | None = None
        self._disk_dir = disk_dir
        self._dropped: list[bytes] = []

    @property
    def nbytes(self) -> int:
        """Bytes held in RAM (the spilled entries are in files)."""
        return sum(b.numel() for b in self.entries.values())

    def apply(self, tensors: CacheTensors, op: MirrorOp) -> None:
        if isinstance(op, MirrorPack):
            self.entries[op.key] = transfer.pack(tensors, op.slot, op.page_ids, op.num_tokens)
            self._dropped = [k for k in self._dropped if k != op.key]  # offloaded again after a drop in the same step
        elif isinstance(op, MirrorSpill):
            buffer = self.entries.pop(op.key, None)
            if buffer is None:
                raise RuntimeError(f"tier mirror: rank 0 spilled host tier entry {op.key.hex()[:16]} to disk, which this rank does not hold (lost mirror op?)")
            self._disk().put(TierEntry(op.key, op.anchor, op.tail, op.num_tokens, buffer))
        elif isinstance(op, MirrorLoad):
            transfer.unpack(self._buffer(op.key), tensors, op.slot, op.page_ids, op.num_tokens)
        else:
            self._dropped.append(op.key)

    def _disk(self) -> DiskTier:
        if self.disk is None:
            if self._disk_dir is None:
                raise RuntimeError("tier mirror: rank 0 spilled an entry to its disk tier, but this rank was given no disk_offload_dir")
            self.disk = DiskTier(self._disk_dir, capacity_bytes=None)
        return self.disk

    def _buffer(self, key: bytes) -> torch.Tensor:
        buffer = self.entries.get(key)
        if buffer is None and self.disk is not None:
            buffer = self.disk.load(key)  # re-hashed against its header: a corrupted file is a miss here too
        if buffer is None:
            # rank 0 found the entry and is unpacking its own shard: this rank cannot follow, and its output would be wrong
            where = f" (its file in {self.disk.dir} is gone or corrupted)" if self.disk is not None else ""
            raise RuntimeError(f"tier mirror: rank 0 loaded tier entry {key.hex()[:16]}, which this rank does not hold{where} (lost mirror op?)")
        return buffer

    def step(self) -> None:
        """Before a step: the drops of the copies since the last one take effect."""
        for key in self._dropped:
            self.entries.pop(key, None)
            if self.disk is not None:
                self.disk.drop(key)
        self._dropped.clear()

    def close(self) -> None:
        """Stop the disk tier's writer and remove its files."""
        if self.disk is not None:
            self.disk.close()
