"""The paged MLA decode Triton kernel (ops/triton/mla_decode.py), under TRITON_INTERPRET=1 without CUDA, against the torch
"mla_decode" (the registry's "naive": the gathered pages in torch ops) on shuffled pages with partial last pages."""

from __future__ import annotations

import pytest
import torch

from openk3.ops.mla import mla_decode_paged, split_kv_b
from openk3.ops.mla.decode_cpu import latent_attention_torch
from openk3.ops.registry import OpTarget, op, registry
from openk3.ops.triton import triton_available

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not triton_available(), reason="triton is not installed (the gpu extra)")]

H, DN, DR, DV, LR = 3, 16, 8, 12, 20  # LR, DR not powers of two: masked columns in the kernel's blocks


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def case(lens: list[int], page_size: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = len(lens)
    widest = max(-(-length // page_size) for length in lens)
    pool = (torch.randn(n * widest + 2, page_size, LR + DR, generator=g) * 2).to(dtype)
    table = torch.randperm(pool.shape[0], generator=g)[: n * widest].view(n, widest)
    w_uk, w_uv = split_kv_b(torch.randn(H * (DN + DV), LR, generator=g) * 0.3, H, DN, DV)
    return torch.randn(n, H, DN, generator=g), torch.randn(n, H, DR, generator=g), pool, table, torch.tensor(lens), w_uk, w_uv


@pytest.mark.parametrize("lens,page_size,dtype", [([1, 7, 40, 33], 16, torch.float32), ([70], 8, torch.float32), ([5, 64], 16, torch.bfloat16)])
def test_latent_attention_equals_torch_op(lens: list[int], page_size: int, dtype: torch.dtype) -> None:
    """One row; a partial last page; several key tiles (the online softmax rescales across tiles); a bf16 latent pool."""
    from openk3.ops.triton.mla_decode import latent_attention_paged

    q_nope, q_pe, pool, table, kv_lens, w_uk, w_uv = case(lens, page_size, dtype)
    want = mla_decode_paged(q_nope, q_pe, pool.float(), table, kv_lens, w_uk, w_uv, 0.3, latent_attention_torch)
    on = lambda t: t.to(device())  # noqa: E731
    fn = op("mla_decode", "triton", OpTarget("cuda"))
    assert fn.func is mla_decode_paged and fn.keywords["latent_attention"].__name__ == "latent_attention_triton"  # type: ignore[attr-defined]
    got = mla_decode_paged(*map(on, (q_nope, q_pe, pool, table, kv_lens, w_uk, w_uv)), 0.3, latent_attention_paged).cpu()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_lengths_and_pages_out_of_range_fail_on_the_device() -> None:
    from openk3.ops.triton.mla_decode import latent_attention_paged

    q = torch.randn(1, H, LR + DR)
    pool = torch.randn(4, 8, LR + DR)
    with pytest.raises(RuntimeError, match="kv_lens"):
        latent_attention_paged(q, pool, torch.tensor([[0, 9]]), torch.tensor([12]), LR)  # page 9 is covered
    with pytest.raises(RuntimeError, match="kv_lens"):
        latent_attention_paged(q, pool, torch.tensor([[0, 1]]), torch.tensor([17]), LR)
    latent_attention_paged(q, pool, torch.tensor([[0, 9]]), torch.tensor([8]), LR)  # page 9 past the length: never read


def test_registered_for_cuda_by_name_only() -> None:
    assert registry().entry("mla_decode", "triton", OpTarget("cuda"))[1].backend == "cuda"
    assert registry().entry("mla_decode", "auto", OpTarget("cuda"))[0] == "naive"  # until measured on hardware (docs/gpu.md)
