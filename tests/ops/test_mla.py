"""MLA ops: the absorbed (latent-space) and SDPA forms equal the expanded reference; paged decode equals the last query row."""

from __future__ import annotations

import pytest
import torch

from openk3.ops.mla import mla_absorbed, mla_decode_paged, mla_expanded, mla_expanded_sdpa, mla_prefill_op, split_kv_b

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


def test_paged_decode_equals_last_row_of_expanded() -> None:
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
    out = mla_decode_paged(q_nope, q_pe, pool, page_table, torch.tensor(lens), w_uk, w_uv, scale)
    torch.testing.assert_close(out, torch.stack(expected), atol=1e-5, rtol=1e-5)


def test_unknown_impl_names_choices() -> None:
    with pytest.raises(ValueError, match="naive"):
        mla_prefill_op("cuda-magic")
