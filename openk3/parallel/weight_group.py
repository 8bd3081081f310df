"""A trainer's weights to a serving process over torch.distributed: one standalone gloo group (SGLang's
`init_weights_update_group` + `update_weights_from_distributed`), rank 0 the trainer (the sender, which hosts the group's
TCPStore), ranks 1.. the engine processes that receive.

The group is its own ProcessGroupGloo over its own store, not torch.distributed's default group: the serving process may
already be in one (its --tp / --ep ranks), and a trainer in its own. Each update is a list of TensorSpecs (name, dtype,
shape) that both sides agree on beforehand (the HTTP request carries them to the engine), then one broadcast per tensor
from rank 0 in that order. Receiving only fills CPU tensors: the engine goes on decoding meanwhile and is paused just for
the copy (api/routes/weights.py).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

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

    def send(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Rank 0: broadcast every tensor, in order (the receivers were given `specs_of(tensors)`)."""
        if self.rank != 0:
            raise RuntimeError(f"WeightGroup.send on rank {self.rank}: only rank 0 (the trainer) sends")
        for t in tensors.values():
            self._broadcast(t.detach().to("cpu").contiguous())

    def receive(self, specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
        """Ranks 1..: the tensors rank 0 sends for `specs`, on the CPU."""
        if self.rank == 0:
            raise RuntimeError("WeightGroup.receive on rank 0: rank 0 (the trainer) sends")
        out = {}
        for spec in specs:
            t = torch.empty(spec.shape, dtype=DTYPES[spec.dtype])
            self._broadcast(t)
            out[spec.name] = t
        return out

    def close(self) -> None:
        """Leave the group (its store's socket closes with the last reference)."""
        del self._group
        del self._store
