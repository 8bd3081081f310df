"""Triton kernels: the "cuda" backend's entries of "moe_experts", "mla_decode" and "mla_prefill" ("triton") in ops/registry.py.

Triton is an optional dependency (the `gpu` extra). Nothing here imports it until an entry is called: the registry lists
the entries on every machine, and asking for one where triton is missing raises an ImportError that says what to install,
never a quiet switch to another implementation.

The kernels run on CUDA tensors, and on CPU tensors only under Triton's interpreter (TRITON_INTERPRET=1, read by triton
when a kernel is defined), which is how the tests prove them without a GPU. A call with CPU tensors outside the
interpreter is refused with an error rather than handed to a kernel that cannot read host memory.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any

import torch

from openk3.ops.moe.bank import ExpertBank
from openk3.ops.moe.naive import Act

INSTALL_HINT = "pip install 'openk3[gpu]' (or pip install triton)"


def triton_available() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Triton's interpreter is on: kernels then run on CPU tensors (numpy), one program at a time."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_module(name: str) -> ModuleType:
    """openk3.ops.triton.<name>, imported on first use; a clear ImportError when triton is not installed."""
    if not triton_available():
        raise ImportError(f"the Triton kernels of openk3.ops.triton need triton, which is not installed: {INSTALL_HINT}")
    return importlib.import_module(f"openk3.ops.triton.{name}")


def require_launchable(op: str, *tensors: torch.Tensor) -> None:
    """Raise unless every tensor is where a Triton kernel can read it: on one CUDA device, or on CPU under the interpreter."""
    devices = {t.device for t in tensors}
    if len(devices) == 1 and ((device := next(iter(devices))).type == "cuda" or (device.type == "cpu" and interpreting())):
        return
    raise RuntimeError(
        f"{op}: the Triton kernel needs its tensors on one CUDA device (or on CPU under TRITON_INTERPRET=1), got {sorted(map(str, devices))}; "
        "choose the ops for the device the model runs on: model.select_ops(target=OpTarget(device=...))"
    )


def moe_experts_triton(x_TD: torch.Tensor, topk_idx: torch.Tensor, topk_weight: torch.Tensor, bank: ExpertBank, act: Act) -> torch.Tensor:
    """The registry's "moe_experts"/"triton" (cuda): routed experts from packed MXFP4 weights (ops/triton/moe_mxfp4.py)."""
    fn: Any = kernel_module("moe_mxfp4").moe_experts_mxfp4
    return fn(x_TD, topk_idx, topk_weight, bank, act)


def latent_attention_triton(q_NHR: torch.Tensor, latent_pool: torch.Tensor, page_table_NP: torch.Tensor, kv_lens_N: torch.Tensor, lr: int) -> torch.Tensor:
    """latent_attention_torch's u [N, H, Lr] by the paged Triton kernel (ops/triton/mla_decode.py)."""
    fn: Any = kernel_module("mla_decode").latent_attention_paged
    return fn(q_NHR, latent_pool, page_table_NP, kv_lens_N, lr)


def mla_prefill_triton(
    q_nope_tHD: torch.Tensor,
    q_pe_tHR: torch.Tensor,
    c_kv_sL: torch.Tensor,
    k_pe_sR: torch.Tensor,
    w_uk_HDL: torch.Tensor,
    w_uv_HDL: torch.Tensor,
    scale: float,
    q_offset: int,
) -> torch.Tensor:
    """The registry's "mla_prefill"/"triton" (cuda): the absorbed-space prefill as a Triton kernel (ops/triton/mla_prefill.py)."""
    fn: Any = kernel_module("mla_prefill").mla_prefill_latent
    return fn(q_nope_tHD, q_pe_tHR, c_kv_sL, k_pe_sR, w_uk_HDL, w_uv_HDL, scale, q_offset)
