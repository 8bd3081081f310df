"""ops/mla/lse.py: partial attentions merged by their log-sum-exp equal one softmax over the concatenated keys, and MLA
decode over interleaved shards of the pages (what each decode-CP rank holds) merges to the paged decode over all of them."""

from __future__ import annotations

import pytest
import torch

from openk3.ops.mla import mla_decode_paged, mla_expanded, split_kv_b
from openk3.ops.mla.lse import merge_by_lse, mla_decode_paged_lse, mla_rows_lse

H, DN, DR, DV, LR = 3, 16, 8, 12, 20


def _part(q_NHK: torch.Tensor, k_SK: torch.Tensor, v_SV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [N, H, V], lse [N, H]) of softmax attention over these keys alone (-inf and zeros when there are none)."""
    scores = torch.einsum("nhk,sk->nhs", q_NHK, k_SK)
    if k_SK.shape[0] == 0:
        return q_NHK.new_zeros(*q_NHK.shape[:2], v_SV.shape[-1]), q_NHK.new_full(q_NHK.shape[:2], float("-inf"))
    return torch.einsum("nhs,sv->nhv", torch.softmax(scores, -1), v_SV), torch.logsumexp(scores, -1)


@pytest.mark.parametrize("cuts", [(0, 5, 9, 17), (0, 0, 17), (0, 1, 2, 3, 17), (0, 17, 17)])
def test_merge_equals_one_softmax_over_the_concatenated_keys(cuts: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, H, 6, generator=g) * 3, torch.randn(17, 6, generator=g), torch.randn(17, 5, generator=g)
    whole, _ = _part(q, k, v)
    parts = [_part(q, k[a:b], v[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    merged = merge_by_lse(torch.stack([o for o, _ in parts]), torch.stack([lse for _, lse in parts]))
    torch.testing.assert_close(merged, whole, atol=1e-6, rtol=1e-6)


def test_merge_refuses_no_key_anywhere_and_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="no key in any part"):
        merge_by_lse(torch.zeros(2, 1, H, 4), torch.full((2, 1, H), float("-inf")))
    with pytest.raises(ValueError, match=r"differ in \[W, N, H\]"):
        merge_by_lse(torch.zeros(2, 1, H, 4), torch.zeros(2, 1, H + 1))


@pytest.mark.parametrize("shards", [1, 2, 3, 4])
def test_interleaved_shards_of_the_pages_merge_to_the_paged_decode(shards: int) -> None:
    """Token p of a sequence on shard p % W, row (p % PS) // W of page table[p // PS]: each shard's pool is [NP, PS / W, R]
    under the same page table, its length the count of positions < kv_len it holds (0 for a short sequence)."""
    g = torch.Generator().manual_seed(1)
    ps, num_pages, lens = 12, 9, [1, 2, 13, 30]
    n = len(lens)
    pool = torch.randn(num_pages, ps, LR + DR, generator=g)
    table = torch.tensor([[3, 0, 8], [1, 2, 4], [5, 6, 7], [7, 5, 6]])  # the last shares pages with the third: any ids
    q_nope, q_pe = torch.randn(n, H, DN, generator=g), torch.randn(n, H, DR, generator=g)
    w_uk, w_uv = split_kv_b(torch.randn(H * (DN + DV), LR, generator=g), H, DN, DV)
    kv = torch.tensor(lens)
    whole = mla_decode_paged(q_nope, q_pe, pool, table, kv, w_uk, w_uv, 0.3)
    outs, lses = [], []
    for r in range(shards):
        local_pool = pool[:, r::shards]  # rows r, r + W, ... of each page: the positions p = r mod W
        local_lens = torch.clamp((kv - r + shards - 1) // shards, min=0)
        out, lse = mla_decode_paged_lse(q_nope, q_pe, local_pool.contiguous(), table, local_lens, w_uk, w_uv, 0.3)
        outs.append(out)
        lses.append(lse)
    torch.testing.assert_close(merge_by_lse(torch.stack(outs), torch.stack(lses)), whole.float(), atol=1e-5, rtol=1e-5)
    # and the paged decode is the reference's last query row
    c, k_pe = pool[table[2]].reshape(-1, LR + DR)[: lens[2]].split([LR, DR], -1)
    ref = mla_expanded(q_nope[2:3], q_pe[2:3], c, k_pe, w_uk, w_uv, 0.3, lens[2] - 1)
    torch.testing.assert_close(whole[2:3], ref, atol=1e-5, rtol=1e-5)


def test_an_empty_part_is_zero_with_minus_infinite_lse() -> None:
    pool = torch.randn(2, 4, LR + DR)
    w_uk, w_uv = split_kv_b(torch.randn(H * (DN + DV), LR), H, DN, DV)
    out, lse = mla_decode_paged_lse(torch.randn(1, H, DN), torch.randn(1, H, DR), pool, torch.tensor([[1]]), torch.tensor([0]), w_uk, w_uv, 0.5)
    assert torch.equal(out, torch.zeros(1, H, DV)) and bool(torch.isneginf(lse).all())


@pytest.mark.parametrize("block", [1, 3, 64])
@pytest.mark.parametrize(("t", "s"), [(1, 1), (5, 5), (4, 19), (7, 0)])
def test_rows_lse_over_blocks_is_the_definition(monkeypatch: pytest.MonkeyPatch, block: int, t: int, s: int) -> None:
    """Every query over every row (the context part of a prefill chunk) and the causal chunk's own rows, in key blocks of
    `block` x t x H scores, against the expanded definition; a context split in two parts merges to the whole context."""
    import openk3.ops.mla.lse as lse_module

    monkeypatch.setattr(lse_module, "ROWS_LSE_SCORE_ELEMENTS", block * t * H)
    g = torch.Generator().manual_seed(t * 31 + s)
    rows = torch.randn(s + t, LR + DR, generator=g)
    q_nope, q_pe = torch.randn(t, H, DN, generator=g), torch.randn(t, H, DR, generator=g)
    w_uk, w_uv = split_kv_b(torch.randn(H * (DN + DV), LR, generator=g), H, DN, DV)
    context, own = rows[:s], rows[s:]
    c, k_pe = rows.split([LR, DR], -1)
    whole = mla_expanded(q_nope, q_pe, c, k_pe, w_uk, w_uv, 0.3, s)  # the chunk at offset s, causal
    own_part = mla_rows_lse(q_nope, q_pe, own, w_uk, w_uv, 0.3, causal=True)
    torch.testing.assert_close(own_part[0], mla_expanded(q_nope, q_pe, c[s:], k_pe[s:], w_uk, w_uv, 0.3, 0), atol=1e-5, rtol=1e-5)
    half = s // 2
    parts = [mla_rows_lse(q_nope, q_pe, context[:half], w_uk, w_uv, 0.3), mla_rows_lse(q_nope, q_pe, context[half:], w_uk, w_uv, 0.3), own_part]
    merged = merge_by_lse(torch.stack([o for o, _ in parts]), torch.stack([lse for _, lse in parts]))
    torch.testing.assert_close(merged, whole, atol=1e-5, rtol=1e-5)
    if s == 0:
        out, lse = parts[0]
        assert torch.equal(out, torch.zeros(t, H, DV)) and bool(torch.isneginf(lse).all())
    with pytest.raises(ValueError, match="causal attention over"):
        mla_rows_lse(q_nope, q_pe, torch.randn(t + 1, LR + DR), w_uk, w_uv, 0.3, causal=True)
