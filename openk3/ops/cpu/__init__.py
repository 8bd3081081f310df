"""Fused CPU kernels in plain C, compiled on first use with the system C compiler and called through ctypes (build.py).

Each kernel is the "c" backend's entry of an op in ops/registry.py, beside the torch entries it is tested against; the
registry offers it only to CPU fp32 inference targets where every kernel builds. An entry is chosen once for its target,
so `require_inference` is not a choice but a guard: a model moved, cast or put under autograd after its ops were chosen
gets an error telling it to choose again, never a kernel that drops the gradient or misreads the dtype.
"""

from __future__ import annotations

import torch


def cpu_fp32(*tensors: torch.Tensor) -> bool:
    """Every tensor is fp32 on CPU: what the kernels (and the CPU-only GEMM forms of ops/linear.py) take."""
    for t in tensors:  # a plain loop: this guard runs ~200 times per decode step, a generator costs twice as much
        if not t.is_cpu or t.dtype is not torch.float32:
            return False
    return True


def cpu_fp32_inference(*tensors: torch.Tensor) -> bool:
    """Every tensor is fp32 on CPU and autograd would record no op on them: what a kernel (or oneDNN's linear, which has
    no backward either) may take."""
    if not cpu_fp32(*tensors):
        return False
    if not torch.is_grad_enabled():
        return True
    for t in tensors:
        if t.requires_grad:
            return False
    return True


def require_cpu_inference(op: str, dtypes: tuple[torch.dtype, ...], *tensors: torch.Tensor) -> None:
    """Raise unless `tensors` are on CPU, of one dtype among `dtypes`, with autograd recording nothing on them: the guard of
    a torch CPU form that takes more than fp32 (the "cpu_half" backend's entries)."""
    dtype = tensors[0].dtype
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if dtype in dtypes and not grad and all(t.is_cpu and t.dtype == dtype for t in tensors):
        return
    got = sorted({f"{t.dtype} on {t.device}" for t in tensors})
    raise RuntimeError(
        f"{op}: this implementation was chosen for CPU inference in one of {[str(d) for d in dtypes]}, but got {', '.join(got)}"
        f"{' with autograd on' if grad else ''}. Choose again for what runs now: model.select_ops(target=OpTarget(device, "
        "training=..., dtype=...)) after moving or casting the model (prepare_for_serving does it for serving)"
    )


def require_inference(op: str, *tensors: torch.Tensor) -> None:
    """Raise unless `tensors` are what an entry of the "c" or "cpu" backend was chosen for (CPU, fp32, autograd off)."""
    if cpu_fp32_inference(*tensors):
        return
    got = sorted({f"{t.dtype} on {t.device}" for t in tensors})
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    raise RuntimeError(
        f"{op}: this implementation was chosen for CPU fp32 inference, but got {', '.join(got)}{' with autograd on' if grad else ''}. "
        "Choose again for what runs now: model.select_ops(target=OpTarget(device, training=..., dtype=...)) after moving or casting "
        "the model (prepare_for_serving does it for serving), OpTarget(training=True) to train, or run under torch.no_grad()"
    )
