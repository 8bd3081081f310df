"""TierMirror: a tensor-parallel rank's copy of rank 0's host tier, made of its own shards.

Why: rank 0's host tier packs rank 0's pools, and a TP rank's pools differ (its KDA heads, its conv channels), so rank 0's
buffers cannot be unpacked there. Instead rank 0's prefix cache logs what its host tier does (model/batch.py's mirror
ops, sent among the copies before each step: parallel/serving/step_channel.py): each offload (`MirrorPack`: the slot
and pages it packed, still unchanged when the worker replays it, since no forward runs in between), each load into a
slot and pages (`MirrorLoad`) and each entry the tier lets go (`MirrorDrop`). The worker packs, unpacks and drops the
same prefixes of its own pools under the same keys, so its mirror holds exactly the keys rank 0's host tier holds, at
its shard's bytes (at most rank 0's: bounded by the same host budget).

A drop is applied at the next step, not at once: rank 0 fetches an entry's buffer before it makes room for the request
(evictions that may push that very entry out of its host tier) and unpacks it after, so within one step's copies a
load may follow the drop of its key.
"""

from __future__ import annotations

import torch

from openk3.model.batch import CacheTensors, MirrorDrop, MirrorLoad, MirrorPack
from openk3.serve.cache import transfer


class TierMirror:
    def __init__(self) -> None:
        self.entries: dict[bytes, torch.Tensor] = {}
        self._dropped: list[bytes] = []

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.entries.values())

    def apply(self, tensors: CacheTensors, op: MirrorPack | MirrorLoad | MirrorDrop) -> None:
        if isinstance(op, MirrorPack):
            self.entries[op.key] = transfer.pack(tensors, op.slot, op.page_ids, op.num_tokens)
            self._dropped = [k for k in self._dropped if k != op.key]  # offloaded again after a drop in the same step
        elif isinstance(op, MirrorLoad):
            buffer = self.entries.get(op.key)
            if buffer is None:
                raise RuntimeError(f"tier mirror: rank 0 loaded host tier entry {op.key.hex()[:16]}, which this rank never packed (lost mirror op?)")
            transfer.unpack(buffer, tensors, op.slot, op.page_ids, op.num_tokens)
        else:
            self._dropped.append(op.key)

    def step(self) -> None:
        """Before a step: the drops of the copies since the last one take effect."""
        for key in self._dropped:
            self.entries.pop(key, None)
        self._dropped.clear()
