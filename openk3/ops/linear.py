"""Projections at serving step sizes on CPU: x W^T for a large weight computed weight-first for a few rows and through
oneDNN for more, and the stacked experts' product computed weight-first.

Legend: M rows, K input width, N output width; batched: A stacked matrices (experts), C rows each.

Why: at decode step sizes a projection streams its whole weight for a handful of rows, so the step time is how fast the
GEMM reads the weight. On CPU in fp32 the MKL GEMM behind F.linear (the weight as its second, transposed operand) reads it
slowly at few rows. Out of cache -- the serving case: a decode step's weights do not fit in the last-level cache -- the
same product with the weight as the first operand, (W x^T)^T, is 1.5-4x faster up to SMALL_ROWS rows (one row is padded
to two, or the call becomes a GEMV, which is as slow as F.linear), and from there on oneDNN's matmul, the kernel torch's
own CPU compiler emits for linear layers (`torch.ops.mkldnn._linear_pointwise`, inference only), is 1.1-1.8x faster. Both
cost a few microseconds more per call, which a small weight does not earn back: they start at LARGE_WEIGHT elements (512
KiB in fp32). The stacked experts' batched product behaves like the few-row case. Figures: `benchmarks/ops_linear.py`,
results in `benchmarks/results/ops_linear.md`. Elsewhere (GPU, autograd, bf16, small weights) these are F.linear and
matmul.

Every path computes the same sums in another order: results agree with F.linear to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.ops.cpu import cpu_fp32, records_grad

LARGE_WEIGHT = 2**17  # below: F.linear (the other forms' extra per-call cost outweighs their faster streaming)
SMALL_ROWS = 8  # up to here the weight-first form; it gains 1.5-4x out of cache and loses from about 12 rows

_onednn = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


def linear(x: torch.Tensor, weight_NK: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight^T -> [..., N], as F.linear(x, weight)."""
    if weight_NK.numel() < LARGE_WEIGHT or not cpu_fp32(x, weight_NK) or records_grad(x, weight_NK):
        return F.linear(x, weight_NK)
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    if 1 <= rows <= SMALL_ROWS:
        x_MK = x.reshape(rows, width)
        if rows == 1:  # a one-column product is a GEMV: two columns keep it a GEMM
            x_MK = torch.cat([x_MK, x_MK])
        y_NM = torch.mm(weight_NK, x_MK.t())
        return y_NM[:, :rows].t().contiguous().view(*x.shape[:-1], weight_NK.shape[0])
    if _onednn is None:
        return F.linear(x, weight_NK)
    return _onednn(x, weight_NK, None, "none", [], "")


def bmm_weight_t(x_ACK: torch.Tensor, weight_ANK: torch.Tensor) -> torch.Tensor:
    """x [A, C, K] @ weight^T per matrix -> [A, C, N] (each expert's rows times its own weight)."""
    if not 1 <= x_ACK.shape[1] <= SMALL_ROWS or not cpu_fp32(x_ACK, weight_ANK):  # plain bmm: autograd is fine
        return torch.matmul(x_ACK, weight_ANK.transpose(1, 2))
    return torch.bmm(weight_ANK, x_ACK.transpose(1, 2)).transpose(1, 2).contiguous()
