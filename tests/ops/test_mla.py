"""MLA ops: the absorbed (latent-space) and SDPA forms equal the expanded reference; paged decode equals the last query row."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from openk3.ops.cpu.build import kernels_available
from openk3.ops.mla import decode_cpu, mla_absorbed, mla_decode_paged, mla_expanded, mla_expanded_sdpa, split_kv_b
from openk3.ops.registry import OpTarget, op, registry

H, DN, DR, DV, LR = 3, 16, 8, 12, 20


def make(t: int, s: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)
    kv_b = r(H * (DN + DV), LR)
    w_uk, w_uv = split_kv_b(kv_b, H, DN, DV)
    return r(t, H, DN), r(t, H, DR), r(s, LR), r(s, DR), w_uk, w_uv


@pytest.mark.parametrize("t,s", [(1, 1), (5, 5), (4, 9), (1, 17)])
def test_absorbed_and_sdpa_equal_expanded(t: int, s: int) -> None:
    q_nope, q_pe, c, k_pe, w_uk, w_uv = make(t, s)
    scale = (DN + DR) ** -0.5
    ref = mla_expanded(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale, s - t)
    torch.testing.assert_close(mla_absorbed(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale, s - t), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mla_expanded_sdpa(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale, s - t), ref, atol=1e-5, rtol=1e-5)


def test_split_kv_b_rows_are_per_head_knope_then_v() -> None:
    w = torch.arange(H * (DN + DV) * LR, dtype=torch.float32).view(H * (DN + DV), LR)
    w_uk, w_uv = split_kv_b(w, H, DN, DV)
    assert torch.equal(w_uk[1, 0], w[DN + DV])
    assert torch.equal(w_uv[2, DV - 1], w[3 * (DN + DV) - 1])


def test_expanded_is_causal_with_offset() -> None:
    q_nope, q_pe, c, k_pe, w_uk, w_uv = make(3, 7)
    scale = 0.1
    full = mla_expanded(q_nope, q_pe, c, k_pe, w_uk, w_uv, scale, 4)
    # the first query (position 4) must not see keys 5 and 6: changing them leaves its output unchanged
    c2 = c.clone()
    c2[5:] += 10.0
    again = mla_expanded(q_nope, q_pe, c2, k_pe, w_uk, w_uv, scale, 4)
    torch.testing.assert_close(again[0], full[0])
    assert not torch.allclose(again[2], full[2])


def _needs_kernel() -> None:
    if not kernels_available():
        pytest.skip("no C compiler: the kernel cannot be built here")


@pytest.fixture(params=["C kernel", "torch ops"])
def paged_decode(request: pytest.FixtureRequest) -> Callable[..., torch.Tensor]:
    """The registry's "mla_decode" with the paged attention as one C call (ops/mla/decode_cpu.py, the "c" backend) and in
    the torch ops it replaces; the tests that take this fixture run with both."""
    if request.param == "C kernel":
        _needs_kernel()
    return op("mla_decode", "auto", OpTarget(c_kernels=request.param == "C kernel"))


@pytest.fixture
def mla_kernel() -> None:
    """For the tests of the C kernel itself (against the torch ops, or its own checks): built, or the test is skipped."""
    _needs_kernel()


def test_paged_decode_equals_last_row_of_expanded(paged_decode: Callable[..., torch.Tensor]) -> None:
    page_size, lens = 4, [1, 6, 9]
    scale = (DN + DR) ** -0.5
    pool = torch.zeros(12, page_size, LR + DR)
    page_table = torch.tensor([[7, 0, 0], [2, 5, 0], [9, 1, 3]])
    q_nope, q_pe, _, _, w_uk, w_uv = make(len(lens), 1)
    expected = []
    for i, n in enumerate(lens):
        _, _, c, k_pe, _, _ = make(1, n, seed=10 + i)
        lat = torch.cat([c, k_pe], dim=-1)
        for p in range(n):
            pool[page_table[i, p // page_size], p % page_size] = lat[p]
        expected.append(mla_expanded(q_nope[i : i + 1], q_pe[i : i + 1], c, k_pe, w_uk, w_uv, scale, n - 1)[0])
    with torch.no_grad():
        out = paged_decode(q_nope, q_pe, pool, page_table, torch.tensor(lens), w_uk, w_uv, scale)
    torch.testing.assert_close(out, torch.stack(expected), atol=1e-5, rtol=1e-5)


def paged_decode_fp64(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    pool: torch.Tensor,
    pages: torch.Tensor,
    length: int,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One sequence's decode attention in float64, spelled out: the reference both fp32 paths are measured against."""
    rows = pool.double()[pages].reshape(-1, pool.shape[-1])[:length]
    q = torch.cat([torch.einsum("hd,hdl->hl", q_nope.double(), w_uk.double()), q_pe.double()], dim=-1) * scale
    u = torch.softmax(q @ rows.T, dim=-1) @ rows[:, :LR]
    return torch.einsum("hl,hvl->hv", u, w_uv.double())


@pytest.mark.parametrize("threads", [1, 2, 8])
@pytest.mark.parametrize("lens", [[700], [3, 64, 65, 130], [1, 1, 1, 1, 1], [1, 3, 2000]])
def test_paged_decode_kernel_equals_torch_ops(mla_kernel: None, monkeypatch: pytest.MonkeyPatch, lens: list[int], threads: int) -> None:
    """Shuffled pages, partial last pages, one long sequence cut into parts that threads take separately (merged after, some
    parts empty when short and long sequences share 8 threads), more sequences than threads; large score ranges (the online
    softmax rescales often)."""
    page_size, n = 16, len(lens)
    g = torch.Generator().manual_seed(sum(lens))
    widest = max((length + page_size - 1) // page_size for length in lens)
    pool = torch.randn(n * widest + 3, page_size, LR + DR, generator=g) * 3
    page_table = torch.randperm(pool.shape[0], generator=g)[: n * widest].view(n, widest)
    q_nope, q_pe, _, _, w_uk, w_uv = make(n, 1, seed=4)
    kv_lens = torch.tensor(lens)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            got = mla_decode_paged(q_nope, q_pe, pool, page_table, kv_lens, w_uk, w_uv, 0.3, decode_cpu.latent_attention_c)
            exact = torch.stack([paged_decode_fp64(q_nope[i], q_pe[i], pool, page_table[i], lens[i], w_uk, w_uv, 0.3) for i in range(n)])
            torch_fp32 = mla_decode_paged(q_nope, q_pe, pool, page_table, kv_lens, w_uk, w_uv, 0.3)
    finally:
        torch.set_num_threads(before)
    error = lambda out: float((out.double() - exact).abs().max() / exact.abs().max())  # noqa: E731
    assert error(got) < max(2 * error(torch_fp32), 1e-6), (error(got), error(torch_fp32))


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("lens", [[700], [3, 64, 65, 130], [1, 3, 2000]])
def test_the_bf16_pool_kernel_equals_the_fp32_kernel_on_the_widened_pool(
    mla_kernel: None, monkeypatch: pytest.MonkeyPatch, lens: list[int], threads: int
) -> None:
    """A bf16 model's cache read by the "c_bf16" entry: each row widened exactly, then the fp32 code -- so the same bits as
    the fp32 kernel over pool.float(), with sequences cut into parts for the threads as there."""
    page_size, n = 16, len(lens)
    g = torch.Generator().manual_seed(7 + sum(lens))
    widest = max((length + page_size - 1) // page_size for length in lens)
    pool = (torch.randn(n * widest + 3, page_size, LR + DR, generator=g) * 3).bfloat16()
    page_table = torch.randperm(pool.shape[0], generator=g)[: n * widest].view(n, widest)
    q = torch.randn(n, H, LR + DR, generator=g)
    kv_lens = torch.tensor(lens)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            got = decode_cpu.latent_attention_c_bf16(q, pool, page_table, kv_lens, LR)
            want = decode_cpu.latent_attention_c(q, pool.float(), page_table, kv_lens, LR)
            torch_form = decode_cpu.latent_attention_torch(q, pool, page_table, kv_lens, LR)
    finally:
        torch.set_num_threads(before)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    torch.testing.assert_close(got, torch_form, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match=r"mla decode: .*one of \['torch.bfloat16'\]"):  # an fp32 pool was chosen for "c"
        decode_cpu.latent_attention_c_bf16(q, pool.float(), page_table, kv_lens, LR)


def test_a_bf16_model_decodes_mla_through_the_bf16_kernel(mla_kernel: None) -> None:
    entry = registry().entry("mla_decode", "auto", OpTarget(dtype=torch.bfloat16))[1]
    assert entry.backend == "c_bf16"
    assert registry().entry("mla_decode", "auto", OpTarget(dtype=torch.float16))[1].backend == "any"


def test_paged_decode_kernel_refuses_lengths_and_pages_out_of_range(mla_kernel: None) -> None:
    pool = torch.randn(4, 8, LR + DR)
    q = torch.randn(2, H, LR + DR)
    table = torch.tensor([[0, 1], [2, 3]])
    with torch.inference_mode():
        want = decode_cpu.latent_attention_torch(q, pool, table, torch.tensor([16, 9]), LR)
        torch.testing.assert_close(decode_cpu.latent_attention_c(q, pool, table, torch.tensor([16, 9]), LR), want)
        # a strided pool and int32 ids are laid out for the kernel first
        strided = pool.transpose(0, 1).contiguous().transpose(0, 1)
        torch.testing.assert_close(decode_cpu.latent_attention_c(q, strided, table.int(), torch.tensor([16, 9]), LR), want)
    empty = decode_cpu.latent_attention_c(q[:0], pool, table[:0], torch.tensor([], dtype=torch.int64), LR)
    assert empty.shape == (0, H, LR)
    for lens, bad_table in (([0, 3], table), ([17, 3], table), ([3, 3], torch.tensor([[0, 1], [4, 3]])), ([3, 9], torch.tensor([[0, 1], [2, -1]]))):
        with pytest.raises(ValueError, match="kv_lens"):
            decode_cpu.latent_attention_c(q, pool, bad_table, torch.tensor(lens), LR)
    with pytest.raises(RuntimeError, match="mla decode: .* with autograd on"):  # chosen for inference: never a quiet fallback
        decode_cpu.latent_attention_c(q.requires_grad_(), pool, table, torch.tensor([3, 3]), LR)


def test_unknown_impl_names_choices() -> None:
    with pytest.raises(ValueError, match="naive"):
        op("mla_prefill", "cuda-magic")
