"""The experts one rank holds for one layer, and their wire format for prefetch.

Legend: E experts of the full bank, n experts in a shard (numbered 0..n-1 locally), I expert intermediate width,
D expert input width (the latent width in a LatentMoE), X bytes per expert on the wire.

A shard keeps the storage of the bank it came from: a DenseExpertBank stays dense in its dtype, a PackedMXFP4ExpertBank
stays packed (codes + E8M0 scales), so prefetching a remote expert moves exactly its resident bytes, 4.25 bits per weight
when packed. Any other bank is decoded to fp32 once when the shard is built.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from openk3.ops.moe.bank import DenseExpertBank, ExpertBank, ExpertWeights
from openk3.ops.moe.packed_bank import PROJECTIONS, PackedMXFP4ExpertBank
from openk3.ops.mxfp4 import MXFP4Tensor

ShardBank = DenseExpertBank | PackedMXFP4ExpertBank


def _parts(bank: ShardBank) -> list[torch.Tensor]:
    if isinstance(bank, PackedMXFP4ExpertBank):
        return [x for t in (bank.w1, bank.w3, bank.w2) for x in (t.packed, t.scales)]
    return [bank.w1_EID, bank.w3_EID, bank.w2_EDI]


def _from_parts(template: ShardBank, parts: list[torch.Tensor]) -> ShardBank:
    if isinstance(template, PackedMXFP4ExpertBank):
        return PackedMXFP4ExpertBank(*(MXFP4Tensor(parts[i], parts[i + 1]) for i in (0, 2, 4)))
    return DenseExpertBank(*parts)


class ExpertShard:
    """Experts `global_ids` of a layer, stored like the bank they came from (copies, so the full bank can be freed)."""

    def __init__(self, bank: ShardBank, global_ids: torch.Tensor) -> None:
        if bank.num_experts != global_ids.shape[0]:
            raise ValueError(f"expert shard: bank has {bank.num_experts} experts, global_ids has {global_ids.shape[0]}")
        self.bank, self.global_ids = bank, global_ids.long().cpu()

    @classmethod
    def from_bank(cls, bank: ExpertBank, global_ids: torch.Tensor) -> ExpertShard:
        ids = global_ids.long().cpu()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= bank.num_experts):
            raise ValueError(f"expert shard: ids {ids.tolist()[:8]} outside 0..{bank.num_experts - 1}")
        if isinstance(bank, (DenseExpertBank, PackedMXFP4ExpertBank)):
            parts = [p.detach().index_select(0, ids.to(p.device)) for p in _parts(bank)]
            return cls(_from_parts(bank, parts), ids)
        experts = [bank.expert(int(e), torch.float32) for e in ids]
        return cls(DenseExpertBank(*(torch.stack(ws).detach() for ws in zip(*experts, strict=True))), ids)

    @classmethod
    def from_checkpoint(cls, tensors: Mapping[str, torch.Tensor], global_ids: torch.Tensor, prefix: str = "") -> ExpertShard:
        """Packed MXFP4 experts `global_ids` read straight from K3 checkpoint tensors (`{prefix}experts.{e}.w1.weight_packed`, ...),
        reading only those experts' keys, so a rank never holds the rest of the layer."""
        ids = global_ids.long().cpu()
        local = {}
        for i, e in enumerate(ids.tolist()):
            for name in PROJECTIONS:
                for suffix in ("weight_packed", "weight_scale"):
                    key = f"{prefix}experts.{e}.{name}.{suffix}"
                    if key not in tensors:
                        raise KeyError(f"checkpoint is missing {key} (expert {e} of this rank's shard)")
                    local[f"{prefix}experts.{i}.{name}.{suffix}"] = tensors[key]
        return cls(PackedMXFP4ExpertBank.from_checkpoint(local, ids.shape[0], prefix), ids)

    @property
    def device(self) -> torch.device:
        return _parts(self.bank)[0].device

    @property
    def expert_nbytes(self) -> int:
        """Bytes one expert takes on the wire (its resident bytes)."""
        return sum(p[0].numel() * p.element_size() for p in _parts(self.bank)) if self.bank.num_experts else 0

    def to_bytes(self, local_ids: torch.Tensor) -> torch.Tensor:
        """uint8 [n, X]: the listed experts' tensors, raw bytes, concatenated per expert (n may be 0)."""
        ids = local_ids.long()
        cols = [p.index_select(0, ids.to(p.device)).reshape(ids.shape[0], p[0].numel()).contiguous().view(torch.uint8) for p in _parts(self.bank)]
        return torch.cat(cols, dim=1)

    def from_bytes(self, data_nX: torch.Tensor) -> ShardBank:
        """A bank of the shard's kind holding the n experts in `data_nX` (inverse of to_bytes)."""
        if data_nX.dim() != 2 or data_nX.shape[1] != self.expert_nbytes:
            raise ValueError(f"expert shard: received {tuple(data_nX.shape)} bytes, expected [n, {self.expert_nbytes}] per expert")
        parts, col = [], 0
        for p in _parts(self.bank):
            width = p[0].numel() * p.element_size()
            raw = data_nX[:, col : col + width].contiguous()
            parts.append(raw.view(p.dtype).reshape(data_nX.shape[0], *p.shape[1:]))
            col += width
        return _from_parts(self.bank, parts)


class SlotBank:
    """The compute set of one rank for one layer: its own experts 0..n-1, then prefetched experts n.. in prefetch order."""

    def __init__(self, local: ExpertBank, prefetched: ExpertBank | None = None) -> None:
        self.local, self.prefetched = local, prefetched

    @property
    def num_experts(self) -> int:
        return self.local.num_experts + (self.prefetched.num_experts if self.prefetched is not None else 0)

    def expert(self, e: int, dtype: torch.dtype) -> ExpertWeights:
        n = self.local.num_experts
        if e < n:
            return self.local.expert(e, dtype)
        if self.prefetched is None or e - n >= self.prefetched.num_experts:
            raise IndexError(f"slot bank: expert slot {e} outside 0..{self.num_experts - 1}")
        return self.prefetched.expert(e - n, dtype)
