"""Expert weight banks: how the MoE ops see a layer's routed experts, whatever their storage.

Legend: E experts, I expert intermediate width, D expert input width (the latent width in a LatentMoE).
A bank hands out one expert's (w1 [I, D], w3 [I, D], w2 [D, I]) at a time, in the compute dtype. That is the seam that
lets packed MXFP4 banks dequantise one expert tile at a time, so the full-precision weights of a whole layer are never
materialised.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import torch


class ExpertWeights(NamedTuple):
    w1: torch.Tensor  # [I, D] gate projection
    w3: torch.Tensor  # [I, D] up projection
    w2: torch.Tensor  # [D, I] down projection


@runtime_checkable
class ExpertBank(Protocol):
    @property
    def num_experts(self) -> int: ...

    def expert(self, e: int, dtype: torch.dtype) -> ExpertWeights: ...


class DenseExpertBank:
    """Full-precision experts stored as stacked tensors [E, I, D], [E, I, D], [E, D, I] (views, no copies)."""

    def __init__(self, w1_EID: torch.Tensor, w3_EID: torch.Tensor, w2_EDI: torch.Tensor) -> None:
        if w1_EID.shape != w3_EID.shape or w2_EDI.shape != (w1_EID.shape[0], w1_EID.shape[2], w1_EID.shape[1]):
            raise ValueError(f"inconsistent expert shapes: w1 {tuple(w1_EID.shape)}, w3 {tuple(w3_EID.shape)}, w2 {tuple(w2_EDI.shape)}")
        self.w1_EID, self.w3_EID, self.w2_EDI = w1_EID, w3_EID, w2_EDI

    @property
    def num_experts(self) -> int:
        return self.w1_EID.shape[0]

    def expert(self, e: int, dtype: torch.dtype) -> ExpertWeights:
        return ExpertWeights(self.w1_EID[e].to(dtype), self.w3_EID[e].to(dtype), self.w2_EDI[e].to(dtype))
