"""fla's KDA kernels (chunk_kda for prefill, fused_recurrent_kda token by token) behind openk3's "kda_prefill" contract:
the "cuda" backend's "fla" and "fla_recurrent" entries in ops/registry.py. fla is an optional dependency (the `gpu`
extra, fla-core): it is imported when an entry is called, and a missing fla is an ImportError naming what to install.

Legend as in naive.py: q, k [B, T, H, K] (L2-normalised), v [B, T, H, V], g [B, T, H, K] log decay, beta [B, T, H],
states [N, H, K, V] fp32, N sequences (packed: B = 1 and cu_seqlens [N + 1]).

The state layout is converted here, at the seam, so that the states a KDA slot pool holds are the same tensors whichever
implementation wrote them (a prefix-cache hit computed on CPU resumes on GPU and back). openk3 keeps S as [K, V] per head;
K3 runs fla's kernels with the state V-first, [V, K] (`state_v_first`, formerly `transpose_state_layout`), the layout the
kernels read with unit stride along K. FLA_STATE_LAYOUT names the layout this seam hands fla.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from enum import Enum
from types import ModuleType
from typing import Any

import torch

from openk3.ops.kda.inference_only import refuse_autograd
from openk3.ops.kda.naive import check_kda_inputs


class StateLayout(str, Enum):
    KEY_FIRST = "kv"  # [N, H, K, V]: openk3's state pools and fla's default
    VALUE_FIRST = "vk"  # [N, H, V, K]: fla with state_v_first=True, as K3 runs it


OPENK3_STATE_LAYOUT = StateLayout.KEY_FIRST
FLA_STATE_LAYOUT = StateLayout.VALUE_FIRST
INSTALL_HINT = "pip install 'openk3[gpu]' (or pip install fla-core)"


def convert_state(state: torch.Tensor, src: StateLayout, dst: StateLayout) -> torch.Tensor:
    """A state [N, H, a, b] from layout `src` to `dst` (contiguous; the same tensor when the layouts agree)."""
    if state.dim() != 4:
        raise ValueError(f"kda state: shape {tuple(state.shape)}, expected [N, H, K, V] or [N, H, V, K]")
    return state if src is dst else state.transpose(-1, -2).contiguous()


def _fla_kda() -> ModuleType:
    try:
        return importlib.import_module("fla.ops.kda")
    except ImportError as e:
        raise ImportError(f"kda_prefill 'fla' / 'fla_recurrent' need fla (flash-linear-attention), which could not be imported ({e}): {INSTALL_HINT}") from e


@functools.cache
def _check_keywords(fn: Callable[..., Any], kernel: str, keywords: tuple[str, ...]) -> None:
    """fla's entries take **kwargs and drop any name they do not know without a word, so a renamed or missing parameter
    (state_v_first was transpose_state_layout before fla-core 0.5.2) would silently run the kernel with the state in the
    wrong layout: every keyword _run passes is checked against the installed fla's signature before the first call."""
    params = inspect.signature(fn).parameters
    missing = [name for name in keywords if name not in params]
    if missing:
        fla = sys.modules.get("fla")
        raise ImportError(
            f"kda_prefill 'fla': fla {getattr(fla, '__version__', '(version unknown)')}'s {kernel} has no parameter {', '.join(missing)} "
            f"(it would ignore it silently); openk3 passes {', '.join(keywords)}: {INSTALL_HINT} with fla-core>=0.6"
        )


def _run(
    kernel: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    refuse_autograd(kernel, q)  # registered inference-only (ops/registry.py): no test covers a backward through this seam
    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)  # on CUDA the cu_seqlens values are asserted on the device
    fn = getattr(_fla_kda(), kernel)
    state = None if initial_state is None else convert_state(initial_state.float(), OPENK3_STATE_LAYOUT, FLA_STATE_LAYOUT)
    keywords = {
        "scale": scale,
        "initial_state": state,
        "output_final_state": True,
        "state_v_first": FLA_STATE_LAYOUT is StateLayout.VALUE_FIRST,
        "cu_seqlens": None if cu_seqlens is None else cu_seqlens.long(),
    }
    _check_keywords(fn, kernel, tuple(keywords))
    o, final = fn(q, k, v, g, beta, **keywords)
    return o.to(v.dtype), convert_state(final.float(), FLA_STATE_LAYOUT, OPENK3_STATE_LAYOUT)


def kda_chunk_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """naive.kda_recurrent's (o, final state) by fla's chunk_kda (the gate and the L2 norm stay outside, as openk3 computes them)."""
    return _run("chunk_kda", q, k, v, g, beta, scale, initial_state, cu_seqlens)


def kda_recurrent_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same by fla's fused_recurrent_kda: one fused token loop, the form for decode-sized steps (T = 1 per sequence)."""
    return _run("fused_recurrent_kda", q, k, v, g, beta, scale, initial_state, cu_seqlens)
