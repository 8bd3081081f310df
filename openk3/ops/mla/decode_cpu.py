"""MLA decode attention over the paged latents on CPU in one call: the C kernel of ops/cpu/mla_decode.c.

Legend: N sequences, H heads, R = Lr + Dr latent row width, Lr kv_lora_rank, NP pages, PS rows per page, P page-table width.

`latent_attention_cpu` returns None whenever the kernel cannot take the call (not built, not CPU fp32 inference, an
unexpected layout); mla_decode_paged then runs its torch ops, which are the reference the kernel is tested against.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from openk3.ops.cpu import cpu_fp32_inference
from openk3.ops.cpu.build import bind

MAX_HEADS, MAX_PAGE = 128, 64  # mla_decode.c keeps a page's scores and each head's running max and sum on the stack


@functools.cache
def _kernel() -> Any:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    argtypes = [i64, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, ctypes.c_int]
    return bind("mla_decode.c", "openk3_mla_decode_latent", argtypes, ctypes.c_int)


def latent_attention_cpu(q_NHR: torch.Tensor, latent_pool: torch.Tensor, page_table_NP: torch.Tensor, kv_lens_N: torch.Tensor, lr: int) -> torch.Tensor | None:
    """u [N, H, Lr] = softmax over each sequence's first kv_lens[n] cached rows of (q . row) times row[:Lr], or None.

    q_NHR is the absorbed query [q~ | q_pe], already scaled. Stricter than the torch path: a length outside 1..P * PS or a
    page id outside the pool raises ValueError (the torch path would return NaN for an empty sequence, attend every
    slot of an over-long one, or fail in index_select)."""
    if q_NHR.dim() != 3 or latent_pool.dim() != 3 or page_table_NP.dim() != 2:
        return None
    n, h, r = q_NHR.shape
    if not (cpu_fp32_inference(q_NHR, latent_pool) and q_NHR.is_contiguous() and latent_pool.is_contiguous()):
        return None
    if latent_pool.shape[2] != r or not 1 <= lr <= r or not 1 <= h <= MAX_HEADS or not 1 <= latent_pool.shape[1] <= MAX_PAGE or page_table_NP.shape[0] != n:
        return None
    if page_table_NP.dtype != torch.int64 or page_table_NP.stride(1) != 1 or kv_lens_N.dtype != torch.int64 or kv_lens_N.shape != (n,):
        return None
    if not (page_table_NP.is_cpu and kv_lens_N.is_cpu and kv_lens_N.is_contiguous()):
        return None
    kernel = _kernel()
    if kernel is None:
        return None
    num_pages, page_size = latent_pool.shape[:2]
    u = q_NHR.new_empty(n, h, lr)
    if n == 0:
        return u
    failed = kernel(
        n, h, r, lr, num_pages, page_size, page_table_NP.shape[1], q_NHR.data_ptr(), latent_pool.data_ptr(), page_table_NP.data_ptr(),
        page_table_NP.stride(0), kv_lens_N.data_ptr(), u.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise ValueError(
            f"mla decode: kv_lens {kv_lens_N.tolist()} must lie in 1..{page_table_NP.shape[1] * page_size} and the pages they cover in 0..{num_pages - 1}"
        )
    return u
