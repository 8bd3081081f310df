"""MXFP4 quantisation-aware training for routed experts: the forward sees the MXFP4 rounding, the master weights stay fp32.

Legend: E experts, I expert intermediate width, D expert input width (as in ops/moe/bank.py).

Forward uses dequant(quant(W)) with the K3 layout's blocks (32 consecutive input features of one output row); backward is
the straight-through estimator: the gradient wrt W is the gradient wrt the fake-quantised weight, unchanged, as if the
rounding were the identity. Exporting quantises the master weights once, so the exported bank decodes to exactly the
weights the fake-quantised forward used.
"""

from __future__ import annotations

from typing import Any

import torch

from openk3.ops.moe.bank import DenseExpertBank, ExpertWeights
from openk3.ops.moe.packed_bank import PackedMXFP4ExpertBank
from openk3.ops.mxfp4 import ScaleMode, dequantize, parse_scale_mode, quantize


class _FakeQuantMXFP4(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, scale_mode: ScaleMode) -> torch.Tensor:
        return dequantize(*quantize(w, scale_mode=scale_mode), dtype=w.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def fake_quantize_mxfp4(w: torch.Tensor, scale_mode: str | ScaleMode = "floor") -> torch.Tensor:
    """dequant(quant(w)) along the last dim, in w's dtype, with a straight-through gradient."""
    return _FakeQuantMXFP4.apply(w, parse_scale_mode(scale_mode))


class FakeQuantExpertBank:
    """An ExpertBank over master weights w1, w3 [E, I, D] and w2 [E, D, I] (e.g. nn.Parameters; held, not copied) that
    hands out fake-quantised experts, differentiable to the master weights."""

    def __init__(self, w1_EID: torch.Tensor, w3_EID: torch.Tensor, w2_EDI: torch.Tensor, scale_mode: str | ScaleMode = "floor") -> None:
        self.master = DenseExpertBank(w1_EID, w3_EID, w2_EDI)  # validates shapes
        self.scale_mode = parse_scale_mode(scale_mode)

    @property
    def num_experts(self) -> int:
        return self.master.num_experts

    def expert(self, e: int, dtype: torch.dtype) -> ExpertWeights:
        m = self.master
        return ExpertWeights(*(fake_quantize_mxfp4(w[e], self.scale_mode).to(dtype) for w in (m.w1_EID, m.w3_EID, m.w2_EDI)))

    def export(self) -> PackedMXFP4ExpertBank:
        """The MXFP4 bank to serve: its expert(e, dtype) equals this bank's expert(e, dtype)."""
        m = self.master
        return PackedMXFP4ExpertBank.from_dense(m.w1_EID.detach(), m.w3_EID.detach(), m.w2_EDI.detach(), self.scale_mode)
