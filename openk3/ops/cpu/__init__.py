"""Fused CPU kernels in plain C, compiled on first use with the system C compiler and called through ctypes (build.py).

Each kernel has a torch reference it is tested against and a caller that falls back to that reference when the kernel is
unavailable (no compiler, OPENK3_CPU_KERNELS=0, another device or dtype). The two checks every caller makes live here.
"""

from __future__ import annotations

import torch


def cpu_fp32(*tensors: torch.Tensor) -> bool:
    """Every tensor is fp32 on CPU: what the kernels (and the CPU-only GEMM forms of ops/linear.py) take."""
    return all(t.is_cpu and t.dtype is torch.float32 for t in tensors)


def cpu_fp32_inference(*tensors: torch.Tensor) -> bool:
    """Every tensor is fp32 on CPU and autograd would record no op on them: what a kernel (or oneDNN's linear, which has
    no backward either) may take."""
    return cpu_fp32(*tensors) and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
