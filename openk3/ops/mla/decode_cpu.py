"""The latent attention of MLA decode over the paged latents: in torch ops, and on CPU in one call of the C kernel of
ops/cpu/mla_decode.c (the "c" backend's "mla_decode", ops/registry.py; over a bf16 cache the "c_bf16" backend's), tested
against the torch form.

Legend: N sequences, H heads, R = Lr + Dr latent row width, Lr kv_lora_rank, NP pages, PS rows per page, P page-table width.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from openk3.ops.cpu import require_cpu_inference, require_inference
from openk3.ops.cpu.build import kernel

MAX_HEADS, MAX_PAGE = 128, 64  # mla_decode.c keeps a page's scores and each head's running max and sum on the stack


@functools.cache
def _kernel(bf16: bool) -> Any:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    argtypes = [i64, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, ctypes.c_int]
    return kernel("mla_decode.c", "openk3_mla_decode_latent_bf16" if bf16 else "openk3_mla_decode_latent", argtypes, ctypes.c_int)


def latent_attention_c(q_NHR: torch.Tensor, latent_pool: torch.Tensor, page_table_NP: torch.Tensor, kv_lens_N: torch.Tensor, lr: int) -> torch.Tensor:
    """latent_attention_torch's u [N, H, Lr] in one C call (the "c" backend).

    Stricter than the torch form: a length outside 1..P * PS or a page id outside the pool raises ValueError (the torch
    form would return NaN for an empty sequence, attend every slot of an over-long one, or fail in index_select). More
    than MAX_HEADS heads or pages of more than MAX_PAGE rows are beyond the kernel's stack buffers: the torch form runs."""
    require_inference("mla decode", q_NHR, latent_pool)
    return _latent_attention(q_NHR, latent_pool, page_table_NP, kv_lens_N, lr, bf16=False)


def latent_attention_c_bf16(q_NHR: torch.Tensor, latent_pool: torch.Tensor, page_table_NP: torch.Tensor, kv_lens_N: torch.Tensor, lr: int) -> torch.Tensor:
    """latent_attention_c over a bf16 pool, a bf16 model's cache (the "c_bf16" backend): the kernel widens each page's rows
    to fp32 (exact: a bf16 value is the top half of its fp32 one) and runs the fp32 code on them, so u [N, H, Lr] (fp32,
    like q) equals latent_attention_c on the pool cast to fp32, without that cast's copy of the whole context."""
    require_cpu_inference("mla decode", (torch.bfloat16,), latent_pool)
    require_inference("mla decode", q_NHR)
    return _latent_attention(q_NHR, latent_pool, page_table_NP, kv_lens_N, lr, bf16=True)


def _latent_attention(
    q_NHR: torch.Tensor, latent_pool: torch.Tensor, page_table_NP: torch.Tensor, kv_lens_N: torch.Tensor, lr: int, bf16: bool
) -> torch.Tensor:
    n, h, r = q_NHR.shape
    pool_ok = latent_pool.dim() == 3 and latent_pool.shape[2] == r and 1 <= lr <= r
    if not pool_ok or page_table_NP.dim() != 2 or page_table_NP.shape[0] != n or kv_lens_N.shape != (n,):
        raise ValueError(
            f"mla decode: q {tuple(q_NHR.shape)}, latent pool {tuple(latent_pool.shape)}, page table {tuple(page_table_NP.shape)}, "
            f"kv_lens {tuple(kv_lens_N.shape)}, lr {lr}: expected [N, H, R], [pages, PS, R], [N, P], [N] and 1 <= lr <= R"
        )
    if not (1 <= h <= MAX_HEADS and 1 <= latent_pool.shape[1] <= MAX_PAGE):
        return latent_attention_torch(q_NHR, latent_pool, page_table_NP, kv_lens_N, lr)
    q_NHR, latent_pool = q_NHR.contiguous(), latent_pool.contiguous()
    table = page_table_NP.to(device="cpu", dtype=torch.int64)
    table = table if table.stride(1) == 1 else table.contiguous()
    lens = kv_lens_N.to(device="cpu", dtype=torch.int64).contiguous()
    num_pages, page_size = latent_pool.shape[:2]
    u = q_NHR.new_empty(n, h, lr)
    if n == 0:
        return u
    failed = _kernel(bf16)(
        n, h, r, lr, num_pages, page_size, table.shape[1], q_NHR.data_ptr(), latent_pool.data_ptr(), table.data_ptr(),
        table.stride(0), lens.data_ptr(), u.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise ValueError(f"mla decode: kv_lens {lens.tolist()} must lie in 1..{table.shape[1] * page_size} and the pages they cover in 0..{num_pages - 1}")
    return u


def latent_attention_torch(q_NHR: torch.Tensor, latent_pool: torch.Tensor, page_table_NP: torch.Tensor, kv_lens_N: torch.Tensor, lr: int) -> torch.Tensor:
    """u [N, H, Lr] = softmax over each sequence's first kv_lens[n] cached rows of (q . row) times row[:Lr], in torch ops.

    q_NHR is the absorbed query [q~ | q_pe], already scaled. Whole pages are gathered as rows (index_select) and the cached
    [c | k_pe] rows used as they lie: the scores are one batched matmul, and the weighted sum runs over the full rows,
    dropping the k_pe columns after (Dr / Lr more arithmetic instead of copying the strided c_kv columns out)."""
    scores_NHS, rows_NSR = masked_latent_scores(q_NHR, latent_pool, page_table_NP, kv_lens_N)
    return torch.matmul(torch.softmax(scores_NHS, dim=-1), rows_NSR)[..., :lr]


def masked_latent_scores(
    q_NHR: torch.Tensor, latent_pool: torch.Tensor, page_table_NP: torch.Tensor, kv_lens_N: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [N, H, S] with -inf past each sequence's kv_lens[n] rows, the gathered rows [N, S, R] fp32), S = P x PS:
    whole pages gathered as rows, the absorbed query against each cached [c | k_pe] row in one batched matmul."""
    n, num_pages = page_table_NP.shape
    ps = latent_pool.shape[1]
    rows_NSR = latent_pool.index_select(0, page_table_NP.reshape(-1)).view(n, num_pages * ps, -1).float()
    scores_NHS = torch.matmul(q_NHR, rows_NSR.transpose(1, 2))
    valid_NS = torch.arange(num_pages * ps, device=scores_NHS.device)[None, :] < kv_lens_N[:, None]
    return scores_NHS.masked_fill_(~valid_NS[:, None, :], float("-inf")), rows_NSR
