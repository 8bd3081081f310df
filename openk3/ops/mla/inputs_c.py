"""An MLA layer's decode inputs with a query LoRA, as one op: the registry's "mla_decode_inputs" -- the fused input
projection q_a | kv_a | g, the query q_b(norm(q_a)), and each new token's latent [norm(c_kv) | k_pe] written into its row
of a plain (fp32) latent pool. `mla_decode_inputs_reference` ("naive": torch ops, the definition) and `mla_decode_inputs_c`
("fast" on the "c" backend: ops/cpu/mla_decode.c openk3_mla_decode_inputs).

Legend: T tokens (one per sequence), Dm model width, Qa q_lora_rank, Lr kv_lora_rank, Dr rope dims, R = Lr + Dr, G the
output gate's width, Q = H * (Dn + Dr) the query width; the fused projection's rows are q_a (Qa), kv_a (R), g (G), as
model/mla.py's ProjectionGroup orders them.

Why: before the attention an MLA decode step made two projection calls, two norms, splits, a concatenation and the latent
write from Python (~10 calls per layer, issue 42); here they are one call of the same code (panels.h, rms_norm.h, a row
copy), so the same bits as the separate calls (tests/ops/test_mla_inputs_c.py). The two small per-head products of the
absorbed attention stay torch's (their GEMM's rounding is not the C loops').
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from openk3.ops.cpu import require_inference
from openk3.ops.cpu.build import kernel
from openk3.ops.norm import rms_norm_reference


class MLAInputWeights(NamedTuple):
    """The weights of an MLA layer's inputs. `panels`: the C form's panel copies of (in_proj, q_b), None for torch."""

    in_proj_WD: torch.Tensor  # [Qa + R + G, Dm]: q_a | kv_a | g
    q_a_norm: torch.Tensor  # [Qa]
    q_a_eps: float
    q_b_QA: torch.Tensor  # [Q, Qa]
    kv_a_norm: torch.Tensor  # [Lr]
    kv_a_eps: float
    latent_rank: int  # Lr
    rope_dim: int  # Dr
    panels: tuple[torch.Tensor, torch.Tensor] | None = None


def mla_decode_inputs_reference(x_TD: torch.Tensor, w: MLAInputWeights, pool_rows_R: torch.Tensor, rows_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [T, Q], the fused projection's output [T, Qa + R + G]); writes the latents into pool_rows_R[rows_T]."""
    qa = w.q_a_norm.shape[0]
    proj = F.linear(x_TD, w.in_proj_WD)
    q = F.linear(rms_norm_reference(proj[:, :qa], w.q_a_norm, w.q_a_eps), w.q_b_QA)
    c_kv, k_pe = proj[:, qa : qa + w.latent_rank], proj[:, qa + w.latent_rank : qa + w.latent_rank + w.rope_dim]
    pool_rows_R.index_copy_(0, rows_T, torch.cat([rms_norm_reference(c_kv, w.kv_a_norm, w.kv_a_eps), k_pe], dim=-1).to(pool_rows_R.dtype))
    return q, proj


@functools.cache
def _kernel() -> Any:
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    argtypes = [i64, i64, ptr, i64, ptr, i64, i64, i64, i64, ptr, f32, ptr, i64, ptr, f32, ptr, i64, ptr, ptr, ptr, ctypes.c_int]
    return kernel("mla_decode.c", "openk3_mla_decode_inputs", argtypes, ctypes.c_int)


def mla_decode_inputs_c(x_TD: torch.Tensor, w: MLAInputWeights, pool_rows_R: torch.Tensor, rows_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same in one C call (needs `w.panels`, a contiguous fp32 pool and contiguous int64 row ids)."""
    require_inference("mla decode inputs", x_TD, w.q_a_norm, w.kv_a_norm, pool_rows_R)
    if w.panels is None:
        raise ValueError("mla_decode_inputs_c: the weights carry no panel copies (MLAInputWeights.panels)")
    t, width = x_TD.shape
    qa, r = w.q_a_norm.shape[0], w.latent_rank + w.rope_dim
    total, q_width = w.in_proj_WD.shape[0], w.q_b_QA.shape[0]
    ok = (
        x_TD.stride(1) == 1 and w.in_proj_WD.shape[1] == width and total >= qa + r and w.q_b_QA.shape[1] == qa
        and w.kv_a_norm.shape == (w.latent_rank,) and pool_rows_R.dim() == 2 and pool_rows_R.shape[1] == r and pool_rows_R.is_contiguous()
        and rows_T.dtype == torch.int64 and rows_T.shape == (t,) and rows_T.is_contiguous()
        and w.q_a_norm.is_contiguous() and w.kv_a_norm.is_contiguous()
    )  # fmt: skip
    if not ok:
        raise ValueError(
            f"mla_decode_inputs_c: x {tuple(x_TD.shape)}, in_proj {tuple(w.in_proj_WD.shape)}, q_b {tuple(w.q_b_QA.shape)}, pool rows"
            f" {tuple(pool_rows_R.shape)}, rows {tuple(rows_T.shape)} {rows_T.dtype}: laid out other than the MLA layer lays them out"
        )
    proj, q = x_TD.new_empty(t, total), x_TD.new_empty(t, q_width)
    if t == 0:
        return q, proj
    in_p, qb_p = w.panels
    status = _kernel()(
        t, width, x_TD.data_ptr(), x_TD.stride(0), in_p.data_ptr(), qa, w.latent_rank, w.rope_dim, total - qa - r,
        w.q_a_norm.data_ptr(), w.q_a_eps, qb_p.data_ptr(), q_width, w.kv_a_norm.data_ptr(), w.kv_a_eps,
        pool_rows_R.data_ptr(), pool_rows_R.shape[0], rows_T.data_ptr(), proj.data_ptr(), q.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if status < 0:
        raise ValueError(f"mla_decode_inputs_c: latent rows span {int(rows_T.min())}..{int(rows_T.max())}, expected 0..{pool_rows_R.shape[0] - 1}")
    if status:
        raise MemoryError("mla_decode_inputs_c: the C kernel could not allocate its scratch rows")
    return q, proj
