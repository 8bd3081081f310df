"""The absorbed-space MLA prefill Triton kernel (ops/triton/mla_prefill.py), under TRITON_INTERPRET=1 without CUDA, against
the definition ("mla_prefill"/"naive": K/V expanded, explicit causal softmax): chunks at the start and in the middle of a
context, several query and key tiles, widths that are not powers of two (masked columns), a bf16 latent."""

from __future__ import annotations

import pytest
import torch

from openk3.ops.mla import split_kv_b
from openk3.ops.mla.naive import mla_expanded
from openk3.ops.registry import OpTarget, registry
from openk3.ops.triton import triton_available

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton is not installed (the gpu extra)")]

H, DN, DR, DV, LR = 3, 16, 8, 12, 20


def case(t: int, s: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w_uk, w_uv = split_kv_b(torch.randn(H * (DN + DV), LR, generator=g) * 0.3, H, DN, DV)
    q_nope, q_pe = torch.randn(t, H, DN, generator=g), torch.randn(t, H, DR, generator=g)
    c_kv, k_pe = (torch.randn(s, LR, generator=g) * 2).to(dtype), (torch.randn(s, DR, generator=g) * 2).to(dtype)
    return q_nope, q_pe, c_kv, k_pe, w_uk, w_uv


@pytest.mark.parametrize(
    "t,s,dtype",
    [(5, 5, torch.float32), (40, 40, torch.float32), (7, 70, torch.float32), (1, 33, torch.float32), (20, 50, torch.bfloat16)],
    ids=["short", "tiles", "mid-context", "one-query", "bf16"],
)
def test_prefill_equals_the_definition(t: int, s: int, dtype: torch.dtype) -> None:
    from openk3.ops.triton.mla_prefill import mla_prefill_latent

    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv = case(t, s, dtype)
    want = mla_expanded(q_nope, q_pe, c_kv.float(), k_pe.float(), w_uk, w_uv, 0.3, s - t)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv = (x.to(dev) for x in (q_nope, q_pe, c_kv, k_pe, w_uk, w_uv))
    got = mla_prefill_latent(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, 0.3, s - t).cpu()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_keys_missing_for_a_query_are_refused() -> None:
    from openk3.ops.triton.mla_prefill import mla_prefill_latent

    q_nope, q_pe, c_kv, k_pe, w_uk, w_uv = case(6, 8, torch.float32)
    with pytest.raises(ValueError, match="needs 9 cached keys, got 8"):
        mla_prefill_latent(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, 0.3, 3)


def test_registered_for_cuda_by_name_only() -> None:
    assert registry().entry("mla_prefill", "triton", OpTarget("cuda"))[1].backend == "cuda"
    assert registry().entry("mla_prefill", "auto", OpTarget("cuda"))[0] != "triton"
