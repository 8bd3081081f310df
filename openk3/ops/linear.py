"""Projections at serving step sizes on CPU: x W^T for a large weight through oneDNN, and the per-expert batched product
computed weight-first.

Legend: M rows, K input width, N output width; batched: A stacked matrices (experts), C rows each.

Why: at decode step sizes a projection streams its whole weight for a handful of rows, so the step time is how fast the
GEMM reads the weight. On CPU in fp32 the MKL GEMM behind F.linear reads it slowly at few rows: the LM head at one row
runs 2x faster, and out of cache 2-3x faster at 1-64 rows, through oneDNN's matmul, the kernel torch's own CPU compiler
emits for linear layers (`torch.ops.mkldnn._linear_pointwise`, inference only). oneDNN costs ~10 us more per call, which a
small, cache-resident weight does not earn back, so it is taken from LARGE_WEIGHT elements (0.5 MiB in fp32) on. The
stacked experts' product (batched over experts) has no oneDNN entry in torch; there the same product with the weight as the
first operand, W x^T, reads it 2-3x faster for up to SMALL_ROWS rows per expert. Figures: `benchmarks/ops_linear.py`,
results in `benchmarks/results/ops_linear.md`. Elsewhere (GPU, autograd, bf16, small weights) these are F.linear and matmul.

Every path computes the same sums in another order: results agree with F.linear to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LARGE_WEIGHT = 2**17  # smaller weights stay in cache, where oneDNN's fixed cost outweighs its faster streaming
SMALL_ROWS = 8  # the weight-first batched product wins 2-3x up to 8 rows per expert and loses from about 12

_onednn = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


def _cpu_fp32(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def linear(x: torch.Tensor, weight_NK: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight^T -> [..., N], as F.linear(x, weight)."""
    if _onednn is None or weight_NK.numel() < LARGE_WEIGHT or not _cpu_fp32(x, weight_NK) or _needs_grad(x, weight_NK):
        return F.linear(x, weight_NK)
    return _onednn(x, weight_NK, None, "none", [], "")


def bmm_weight_t(x_ACK: torch.Tensor, weight_ANK: torch.Tensor) -> torch.Tensor:
    """x [A, C, K] @ weight^T per matrix -> [A, C, N] (each expert's rows times its own weight)."""
    if not 1 <= x_ACK.shape[1] <= SMALL_ROWS or not _cpu_fp32(x_ACK, weight_ANK):
        return torch.matmul(x_ACK, weight_ANK.transpose(1, 2))
    return torch.bmm(weight_ANK, x_ACK.transpose(1, 2)).transpose(1, 2).contiguous()
