"""The fixed-shape routed-expert form (ops/moe/static.py): equal to the definition for dense and packed banks, every
expert asked for once whatever the routing, no host read (what a decode graph runs, serve/graphs.py)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from openk3.ops.activation import silu_glu
from openk3.ops.moe import DenseExpertBank, moe_experts_grouped, moe_experts_naive, moe_experts_static
from openk3.ops.moe.packed_bank import PackedMXFP4ExpertBank
from tests.serve.test_sync_decode import recording_host_reads


def _case(t: int, e: int, k: int, d: int, i: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DenseExpertBank]:
    g = torch.Generator().manual_seed(seed)
    bank = DenseExpertBank(torch.randn(e, i, d, generator=g) / d**0.5, torch.randn(e, i, d, generator=g) / d**0.5, torch.randn(e, d, i, generator=g) / i**0.5)
    x = torch.randn(t, d, generator=g)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return x, idx, torch.rand(t, k, generator=g), bank


class LoopingBank:
    """A bank without stacked weights: the static form goes expert by expert."""

    def __init__(self, inner: DenseExpertBank) -> None:
        self.inner, self.requested = inner, Counter[int]()

    @property
    def num_experts(self) -> int:
        return self.inner.num_experts

    def expert(self, e: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]
        self.requested[e] += 1
        return self.inner.expert(e, dtype)


@pytest.mark.parametrize("t,e,k", [(1, 4, 2), (5, 8, 3), (16, 6, 6)])
def test_static_equals_naive_dense_and_expert_by_expert(t: int, e: int, k: int) -> None:
    x, idx, w, bank = _case(t, e, k, 32, 64, seed=t + e)
    want = moe_experts_naive(x, idx, w, bank, silu_glu)
    torch.testing.assert_close(moe_experts_static(x, idx, w, bank, silu_glu), want, rtol=1e-5, atol=1e-5)
    looping = LoopingBank(bank)
    torch.testing.assert_close(moe_experts_static(x, idx, w, looping, silu_glu), want, rtol=1e-5, atol=1e-5)
    assert looping.requested == Counter(range(e)), "every expert once, whatever the routing: the shapes do not depend on it"


def test_static_equals_grouped_on_packed_mxfp4_experts() -> None:
    x, idx, w, dense = _case(6, 8, 2, 64, 64, seed=3)
    packed = PackedMXFP4ExpertBank.from_dense(dense.w1_EID, dense.w3_EID, dense.w2_EDI)
    torch.testing.assert_close(moe_experts_static(x, idx, w, packed, silu_glu), moe_experts_grouped(x, idx, w, packed, silu_glu), rtol=1e-5, atol=1e-5)


def test_static_reads_nothing_back(monkeypatch: pytest.MonkeyPatch) -> None:
    x, idx, w, bank = _case(4, 8, 2, 16, 16, seed=5)
    sites: Counter[str] = Counter()
    with recording_host_reads(sites, monkeypatch):
        moe_experts_static(x, idx, w, bank, silu_glu)
    assert not sites, f"host reads: {dict(sites)}"
