"""A trainer's weights to a serving process over torch.distributed: one standalone gloo group (SGLang's
`init_weights_update_group` + `update_weights_from_distributed`), rank 0 the trainer (the sender, which hosts the group's
TCPStore), ranks 1.. the engine processes that receive.

The group is its own ProcessGroupGloo over its own store, not torch.distributed's default group: the serving process may
already be in one (its --tp / --ep ranks), and a trainer in its own. Each update is a list of TensorSpecs (name, dtype,
shape) that both sides agree on beforehand (the HTTP request carries them to the engine), then the tensors in that order,
packed into flat buffers of one dtype and at most `BUCKET_BYTES` (a larger tensor goes alone): one broadcast per bucket,
as a per-tensor broadcast is bound by its round trip for the many small tensors of a model. Receiving only fills CPU
tensors: the engine goes on decoding meanwhile and is paused just for the copy (api/routes/weights.py).
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

BUCKET_BYTES = 64 * 2**20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8, "int8": torch.int8}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # a key of DTYPES
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"TensorSpec {self.name!r}: dtype {self.dtype!r}, expected one of {sorted(DTYPES)}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"TensorSpec {self.name!r}: shape {self.shape} has a negative dimension")

    @staticmethod
    def of(name: str, tensor: torch.Tensor) -> TensorSpec:
        names = {v: k for k, v in DTYPES.items()}
        if tensor.dtype not in names:
            raise ValueError(f"TensorSpec {name!r}: dtype {tensor.dtype} cannot be sent, expected one of {sorted(DTYPES)}")
        return TensorSpec(name, names[tensor.dtype], tuple(tensor.shape))


def specs_of(tensors: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec.of(name, t) for name, t in tensors.items()]


def _numel(spec: TensorSpec) -> int:
    return math.prod(spec.shape)


def buckets(specs: Sequence[TensorSpec], bucket_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """Runs of consecutive specs of one dtype, each at most `bucket_bytes` (0: one tensor per bucket)."""
    out: list[list[int]] = []
    size = 0
    for i, spec in enumerate(specs):
        nbytes = _numel(spec) * DTYPES[spec.dtype].itemsize
        last = out[-1] if out else None
        if last is not None and specs[last[0]].dtype == spec.dtype and size + nbytes <= bucket_bytes:
            last.append(i)
            size += nbytes
        else:
            out.append([i])
            size = nbytes
    return out


class WeightGroup:
    """This process's end of the group; constructing it blocks until every rank has joined (or `timeout_s` passes)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0) -> None:
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"WeightGroup: rank {rank} of world_size {world_size}, expected world_size >= 2 and 0 <= rank < world_size")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size = rank, world_size
        self._store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
        self._group = dist.ProcessGroupGloo(self._store, rank, world_size, timeout)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._group.broadcast([tensor], opts).wait()  # type: ignore[attr-defined]  # the stubs omit the list form gloo has

    def send(self, tensors: Mapping[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> None:
        """Rank 0: broadcast every tensor, in order, bucketed (the receivers were given `specs_of(tensors)` and the same
        `bucket_bytes`)."""
        if self.rank != 0:
            raise RuntimeError(f"WeightGroup.send on rank {self.rank}: only rank 0 (the trainer) sends")
        values = [t.detach().to("cpu") for t in tensors.values()]
        for bucket in buckets(specs_of(tensors), bucket_bytes):
            if len(bucket) == 1:
                self._broadcast(values[bucket[0]].contiguous())
            else:
                self._broadcast(torch.cat([values[i].reshape(-1) for i in bucket]))

    def receive(self, specs: Sequence[TensorSpec], bucket_bytes: int = BUCKET_BYTES) -> dict[str, torch.Tensor]:
        """Ranks 1..: the tensors rank 0 sends for `specs`, on the CPU."""
        if self.rank == 0:
            raise RuntimeError("WeightGroup.receive on rank 0: rank 0 (the trainer) sends")
        out = {}
        for bucket in buckets(specs, bucket_bytes):
            numels = [_numel(specs[i]) for i in bucket]
            flat = torch.empty(sum(numels), dtype=DTYPES[specs[bucket[0]].dtype])
            self._broadcast(flat)
            for i, part in zip(bucket, flat.split(numels), strict=True):
                out[specs[i].name] = part.view(specs[i].shape)
        return out

    def close(self) -> None:
        """Leave the group (its store's socket closes with the last reference)."""
        del self._group
        del self._store
